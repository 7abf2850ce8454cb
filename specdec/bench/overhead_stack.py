"""The servers and clients `specd overhead` measures (specdec/bench/overhead.py):
tiny random engines, a bare grpc.aio echo server (the floor of a call and of
a stream message), and a `Stack` of a target and a draft service with the
orchestrator's own clients of them, on call streams and as unary calls,
plaintext or over mutual TLS."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec import eventloop

DEADLINE_S = 60.0
BARE_SERVICE = "specdec.bench.Bare"


def tiny_model(vocab_size: int = 128, seed: int = 0, arch: str = "llama"):
    """A 2-layer random Llama (or Qwen2) in float32 (the tests' tiny model at init_range 0.3)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def tiny_engine(vocab_size: int = 128, seed: int = 0, arch: str = "llama", model=None, name: str = ""):
    """An engine over `tiny_model` (or `model`): steps of about a millisecond."""
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine

    model = model if model is not None else tiny_model(vocab_size, seed, arch)
    name = name or (f"tiny-v{vocab_size}" if arch == "llama" else f"tiny-{arch}-v{vocab_size}")
    return ModelEngine(model, EngineConfig(dtype="float32", max_kv_bytes=1 << 28), name=name)


# --------------------------------------------------------------- the servers


def BackgroundLoop() -> eventloop.BackgroundLoop:
    """The servers' event loop on its own thread (the roles' loop, uvloop when installed)."""
    return eventloop.BackgroundLoop(timeout_s=DEADLINE_S, name="overhead-servers")


async def start_bare_server():
    """A grpc.aio server with two generic echo handlers: unary and bidi."""
    import grpc

    async def echo(request: bytes, context) -> bytes:
        return request

    async def echo_stream(requests, context):
        async for message in requests:
            yield message

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(BARE_SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@dataclass
class Stack:
    """A target and a draft service over tiny engines, and the orchestrator's
    clients of them; `telemetry` is the client side's (its spans, its trace
    context on the calls)."""

    target: object
    draft: object
    verifier: object
    drafter: object
    target_client: object
    draft_client: object
    telemetry: object
    unary_target_client: object  # the same calls as unary calls, not on call streams
    unary_draft_client: object

    async def close_clients(self) -> None:
        for client in (self.target_client, self.draft_client, self.unary_target_client, self.unary_draft_client):
            await client.aclose()


def start_stack(bg: eventloop.BackgroundLoop, tracing: bool, trace_dir: Path, tls=None) -> Stack:
    """`tls`: a LocalTls, whose certificates then secure both services with
    mutual TLS and the clients' channels with the orchestrator's certificate."""
    from draft_service.drafters import ModelDrafter
    from draft_service.server import start_draft_service
    from orchestrator.downstream import DraftClient, TargetClient, channel_to
    from specdec.rpc.model_service import SessionLimits
    from specdec.rpc.serving import ServerConfig
    from specdec.security.tls import ClientTls
    from specdec.telemetry import TelemetrySettings, setup_telemetry
    from target_service.server import start_target_service
    from target_service.verifier import Verifier

    def telemetry(role: str):
        settings = TelemetrySettings(tracing=tracing, trace_file=str(trace_dir / "spans.jsonl") if tracing else "")
        return setup_telemetry(role, settings)

    limits = SessionLimits()
    verifier = Verifier(tiny_engine(seed=0), limits.max_draft_tokens, limits.max_verify_batch)
    drafter = ModelDrafter(tiny_engine(seed=1), limits.max_draft_tokens)
    cfg = ServerConfig(host="127.0.0.1", port=0)
    target = bg.run(start_target_service(cfg, limits, lambda: verifier, telemetry=telemetry("target"),
                                         tls=_service_tls(tls, "target")))
    draft = bg.run(start_draft_service(cfg, limits, lambda: drafter, telemetry=telemetry("draft"),
                                       tls=_service_tls(tls, "draft")))
    target_at, draft_at = f"127.0.0.1:{target.port}", f"127.0.0.1:{draft.port}"

    def channel(address: str):
        if tls is None:
            return channel_to(address)
        own = tls.files["orchestrator"]
        return channel_to(address, credentials=ClientTls(own.ca, own.cert, own.key).channel_credentials())

    return Stack(target, draft, verifier, drafter, TargetClient(channel(target_at)),
                 DraftClient(channel(draft_at)), telemetry("orchestrator"),
                 TargetClient(channel(target_at), call_streams=False),
                 DraftClient(channel(draft_at), call_streams=False))


def _service_tls(tls, role: str):
    from specdec.security.tls import TlsConfig

    if tls is None:
        return None
    own = tls.files[role]
    return TlsConfig(tls_cert=own.cert, tls_key=own.key, tls_ca=own.ca)
