"""The Python client of the orchestrator.

    from orchestrator.client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("def fib(n):", max_tokens=64, temperature=0):
            print(chunk.text, end="", flush=True)
        print(client.last_stats)

Over TLS, with an API key (docs/security.md):

    Client("orch.example:50051", api_key="...", tls=ClientTls(ca="ca.crt"))
"""
from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc

from specdec.security.tls import ClientTls, is_loopback
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: list[int]


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: pb.GenerateStats | None = None


def build_request(prompt: str | Sequence[int] | Sequence[dict] | None = None, *, max_tokens: int = 0,
                  temperature: float | None = None, top_k: int = 0, top_p: float | None = None,
                  seed: int | None = None, stop: Sequence[str] = (), policy: str = "",
                  num_draft_tokens: int = 0, speculate: bool = True, pipeline: bool | None = None,
                  draft_min_confidence: float | None = None, request_id: str = "") -> pb.GenerateRequest:
    """A GenerateRequest: prompt is text, token ids, or chat messages
    ([{"role": "user", "content": "..."}]). pipeline, draft_min_confidence
    None: the server's default."""
    request = pb.GenerateRequest(max_tokens=max_tokens, top_k=top_k, stop=list(stop), request_id=request_id,
                                 speculation=pb.SpeculationOptions(policy=policy, num_draft_tokens=num_draft_tokens,
                                                                   disable=not speculate))
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in prompt]))
    elif prompt:
        request.prompt_token_ids.CopyFrom(pb.TokenIds(token_ids=list(prompt)))
    if pipeline is not None:
        request.speculation.pipeline = pipeline
    if draft_min_confidence is not None:
        request.speculation.draft_min_confidence = draft_min_confidence
    if temperature is not None:
        request.temperature = temperature
    if top_p is not None:
        request.top_p = top_p
    if seed is not None:
        request.seed = seed
    return request


def _host_of(address: str) -> str:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port")."""
    target = address.split("///", 1)[-1]
    if target.startswith("["):
        return target[1:].split("]", 1)[0]
    if target.count(":") == 1:
        return target.split(":", 1)[0]
    return target  # a bare host, or an IPv6 address without a port


RETRY_S = 0.5  # between calls while a server that is up gets ready (wait_for_ready)


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", timeout_s: float = 600.0, wait_for_ready: bool = False,
                 api_key: str | None = None, tls: ClientTls | None = None):
        """timeout_s is each request's deadline; wait_for_ready makes a request
        wait (within it) for a server that is not up yet instead of failing.
        api_key is sent as `authorization: Bearer KEY`; tls (a CA to verify
        the server with, and a client certificate if it asks for one) makes
        the channel TLS."""
        if tls is not None and tls.enabled:
            self.channel = grpc.secure_channel(address, tls.validate("the client's TLS").channel_credentials())
        else:
            if api_key and not is_loopback(_host_of(address)):
                warnings.warn(f"the API key goes to {address} in plaintext, readable by anyone on the way: "
                              "give the server's CA (tls=ClientTls(ca=...); specd generate --ca-cert)",
                              stacklevel=2)
            self.channel = grpc.insecure_channel(address)
        self.stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.wait_for_ready = wait_for_ready
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.last_stats: pb.GenerateStats | None = None

    def generate(self, prompt, **kwargs) -> Iterator[Chunk]:
        """Stream chunks as tokens are accepted; `last_stats` is set at the end.
        `prompt` and `kwargs` are `build_request`'s, or `prompt` is a
        GenerateRequest already built (and no kwargs).

        With wait_for_ready, a server that is up but not ready yet (an
        orchestrator still connecting to its services answers UNAVAILABLE)
        is waited out too, within the deadline: the call is made again until
        its first reply arrives."""
        self.last_stats = None
        if isinstance(prompt, pb.GenerateRequest):
            if kwargs:
                raise TypeError(f"a built GenerateRequest takes no request settings ({', '.join(sorted(kwargs))})")
            request = prompt
        else:
            request = build_request(prompt, **kwargs)
        deadline = time.monotonic() + self.timeout_s
        while True:
            replies = self.stub.Generate(request, timeout=max(0.0, deadline - time.monotonic()),
                                         wait_for_ready=self.wait_for_ready, metadata=self.metadata)
            try:
                first = next(replies, None)
                break
            except grpc.RpcError as exc:
                if not (self.wait_for_ready and exc.code() == grpc.StatusCode.UNAVAILABLE
                        and time.monotonic() + RETRY_S < deadline):
                    raise
                time.sleep(RETRY_S)
        for reply in itertools.chain([first] if first is not None else [], replies):
            if reply.HasField("stats"):
                self.last_stats = reply.stats
            else:
                yield Chunk(reply.chunk.text, list(reply.chunk.token_ids))

    def complete(self, prompt, **kwargs) -> Result:
        """Generate to the end and return the text, tokens and statistics."""
        result = Result()
        for chunk in self.generate(prompt, **kwargs):
            result.text += chunk.text
            result.token_ids.extend(chunk.token_ids)
        result.stats = self.last_stats
        return result

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
