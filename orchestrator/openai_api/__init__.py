"""The OpenAI-compatible HTTP front door of the orchestrator.

`/v1/completions`, `/v1/chat/completions`, `/v1/models` and `/health`, served
by FastAPI on uvicorn inside the orchestrator's process and event loop, beside
the gRPC server. Each request is translated into a `GenerateRequest` and runs
on the same request path as gRPC Generate (`OrchestratorServicer.generate`):
one loop, one set of checks, one set of statistics.

- `config.py`: the flags (`--http-port`, ...);
- `schemas.py`: request bodies as pydantic models;
- `translate.py`: request -> GenerateRequest, statistics -> usage and metrics (pure);
- `errors.py`: the core's errors -> HTTP status and the OpenAI error JSON;
- `runner.py`: one request on the shared path, in a task of its own, traced;
- `app.py`: the routes and the SSE stream; `server.py`: uvicorn in our loop;
- `body_limit.py`, `concurrency.py`: ASGI middleware bounding a request's body
  (413) and the requests in flight (503).
"""
