"""The servers and clients `specd overhead` measures (specdec/bench/overhead.py):
tiny random engines and a `Stack` of a target and a draft service with the
orchestrator's own clients of them, on call streams and as unary calls,
plaintext or over mutual TLS; the services each in a process of their own,
as deployed, or in this process."""
from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec import eventloop
from specdec.processes import Service, close_stdin_and_wait, read_port

DEADLINE_S = 60.0
START_S = 600.0  # for a service process to import torch and build its engine, many starting at once


def tiny_model(vocab_size: int = 128, seed: int = 0, arch: str = "llama", layers: int = 2):
    """A random Llama (or Qwen2), 2 layers unless told, in float32 (the tests' tiny model at init_range 0.3)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
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


class ChildService:
    """A service of the stack in a process of its own
    (specdec/bench/overhead_service.py), its output in LOG_DIR/ROLE-N.log,
    its port read off its "listening on" line (`processes.read_port`)."""

    _numbers = itertools.count()

    def __init__(self, role: str, seed: int, threads: int, log_dir: Path, trace_file: str = "", tls_files=None,
                 env: dict | None = None, busy_poll_us: dict[str, int] | None = None):
        # busy_poll_us: each role's --busy-poll-us (this service takes its own role's; none: off)
        command = [sys.executable, "-m", "specdec.bench.overhead_service", "--role", role, "--seed", str(seed),
                   "--threads", str(threads), "--busy-poll-us", str((busy_poll_us or {}).get(role, 0))]
        if trace_file:
            command += ["--trace-file", trace_file]
        if tls_files is not None:
            command += ["--tls-cert", str(tls_files.cert), "--tls-key", str(tls_files.key),
                        "--tls-ca", str(tls_files.ca)]
        log_path = log_dir / f"{role}-{next(self._numbers)}.log"
        with open(log_path, "w") as log:  # the child holds its own descriptor
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.service = Service(role, process, log_path, command)
        self.process = process

    @property
    def port(self) -> int:
        """The service's port, once it has logged it (waits up to START_S)."""
        if not self.service.port:
            self.service.port = read_port(self.service, START_S)
        return self.service.port

    async def stop(self, grace_s: float = 0.0) -> None:
        # It stops itself when its stdin closes, in well under a second; the
        # wait ends then. Killed only past 30 s: on a loaded machine a child's
        # exit took 7-9 s, and a 5 s limit killed healthy children.
        close_stdin_and_wait(self.process, max(grace_s, 30.0))


@dataclass
class Stack:
    """A target and a draft service over tiny engines, and the orchestrator's
    clients of them (on the services' lanes once `use_lanes` ran; beside them
    the same on gRPC call streams, and as unary calls); `telemetry` is the client side's (its spans, its trace
    context on the calls). `verifier` and `drafter` are the same engines
    (the services' own when they run in this process, copies built from the
    same seeds when they run in their own processes), for the same compute
    in-process."""

    target: object
    draft: object
    verifier: object
    drafter: object
    target_client: object
    draft_client: object
    telemetry: object
    unary_target_client: object  # the same calls as unary calls, not on call streams
    unary_draft_client: object
    stream_target_client: object  # on the gRPC call streams, not on the services' lanes
    stream_draft_client: object
    tls: object = None  # the LocalTls the services speak, if any

    async def use_lanes(self) -> None:
        """Send `target_client`'s and `draft_client`'s round calls on the
        services' lanes, as the orchestrator does (specdec/rpc/lane.py)."""
        from orchestrator.downstream import LaneDialing
        from specdec.security.tls import ClientTls

        dialing = None
        if self.tls is not None:
            own = self.tls.files["orchestrator"]
            dialing = LaneDialing(ClientTls(own.ca, own.cert, own.key).ssl_context(), "localhost")
        for client in (self.target_client, self.draft_client):
            await client.fetch_info(DEADLINE_S)
            if not client.use_lane("127.0.0.1", dialing):
                raise RuntimeError(f"the {client.name} service offers no lane")

    async def close_clients(self) -> None:
        for client in (self.target_client, self.draft_client, self.unary_target_client, self.unary_draft_client,
                       self.stream_target_client, self.stream_draft_client):
            await client.aclose()


@dataclass(frozen=True)
class StackSpec:
    tracing: bool
    tls: object = None  # a LocalTls: both services speak mutual TLS, the clients present the orchestrator's cert
    in_process: bool = False  # the services on `bg` in this process, not each in a process of its own


def start_stacks(bg: eventloop.BackgroundLoop, specs: list[StackSpec], trace_dir: Path,
                 threads: int = 1, busy_poll_us: dict[str, int] | None = None) -> list[Stack]:
    """One stack per spec. The services of a stack run each in a process of
    its own, as deployed (all processes are started before any is waited
    for), or with `in_process` on `bg`, in this process. `busy_poll_us`:
    each service process's --busy-poll-us, by role (default 0: off)."""
    from draft_service.drafters import ModelDrafter
    from draft_service.server import start_draft_service
    from specdec.rpc.session_limits import SessionLimits
    from specdec.rpc.serving import ServerConfig
    from target_service.server import start_target_service
    from target_service.verifier import Verifier

    limits = SessionLimits()
    trace_file = str(trace_dir / "spans.jsonl")
    built = []
    for spec in specs:
        verifier = Verifier(tiny_engine(seed=0), limits.max_draft_tokens, limits.max_verify_batch)
        drafter = ModelDrafter(tiny_engine(seed=1), limits.max_draft_tokens)
        if spec.in_process:
            cfg = ServerConfig(host="127.0.0.1", port=0)
            target = bg.run(start_target_service(cfg, limits, lambda: verifier, telemetry=_telemetry(spec, "target", trace_file),
                                                 tls=_service_tls(spec.tls, "target")))
            draft = bg.run(start_draft_service(cfg, limits, lambda: drafter, telemetry=_telemetry(spec, "draft", trace_file),
                                               tls=_service_tls(spec.tls, "draft")))
        else:
            files = (lambda role: spec.tls.files[role]) if spec.tls is not None else (lambda role: None)
            target = ChildService("target", 0, threads, trace_dir, trace_file if spec.tracing else "", files("target"),
                                  busy_poll_us=busy_poll_us)
            draft = ChildService("draft", 1, threads, trace_dir, trace_file if spec.tracing else "", files("draft"),
                                 busy_poll_us=busy_poll_us)
        built.append((spec, target, draft, verifier, drafter))
    return [_stack(spec, target, draft, verifier, drafter, trace_file)
            for spec, target, draft, verifier, drafter in built]


def start_stack(bg: eventloop.BackgroundLoop, tracing: bool, trace_dir: Path, tls=None,
                in_process: bool = True) -> Stack:
    """One stack (`start_stacks`), its services in this process unless told otherwise."""
    return start_stacks(bg, [StackSpec(tracing, tls, in_process)], trace_dir)[0]


def _telemetry(spec: StackSpec, role: str, trace_file: str):
    from specdec.telemetry import TelemetrySettings, setup_telemetry

    return setup_telemetry(role, TelemetrySettings(tracing=spec.tracing,
                                                   trace_file=trace_file if spec.tracing else ""))


def _stack(spec: StackSpec, target, draft, verifier, drafter, trace_file: str) -> Stack:
    from orchestrator.downstream import DraftClient, TargetClient, channel_to
    from specdec.security.tls import ClientTls

    target_at, draft_at = f"127.0.0.1:{target.port}", f"127.0.0.1:{draft.port}"

    def channel(address: str):
        if spec.tls is None:
            return channel_to(address)
        own = spec.tls.files["orchestrator"]
        return channel_to(address, credentials=ClientTls(own.ca, own.cert, own.key).channel_credentials())

    return Stack(target, draft, verifier, drafter, TargetClient(channel(target_at)),
                 DraftClient(channel(draft_at)), _telemetry(spec, "orchestrator", trace_file),
                 TargetClient(channel(target_at), call_streams=False),
                 DraftClient(channel(draft_at), call_streams=False),
                 TargetClient(channel(target_at)), DraftClient(channel(draft_at)), spec.tls)


def _service_tls(tls, role: str):
    from specdec.security.tls import TlsConfig

    if tls is None:
        return None
    own = tls.files[role]
    return TlsConfig(tls_cert=own.cert, tls_key=own.key, tls_ca=own.ca)
