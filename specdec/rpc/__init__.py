"""The gRPC plumbing the three roles share, kept apart from the pure core.

`grpc_io` chooses grpc's I/O engine before grpc starts; `serving` binds a
server (health, reflection, graceful drain) and runs engine calls on one
worker thread; `model_service` holds what the draft and target
services share (session limits, session RPCs); `model_server` starts either
of them; `grpc_errors` maps the core's errors (`specdec.errors`) to gRPC
statuses; `grpc_tracing` carries the trace context in call metadata. The server
interceptors `auth` and `malformed` wrap a method's behavior through
`method_handlers`.
"""
