"""`specd serve draft|target|orchestrator`: one role per process."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys

from draft_service.config import DEFAULT_PORT as DRAFT_PORT
from draft_service.config import DrafterConfig
from orchestrator.config import DEFAULT_PORT as ORCH_PORT
from orchestrator.config import OrchestratorConfig
from orchestrator.openai_api.config import HttpConfig
from specdec import busy_poll, cpu_latency, eventloop, heap
from specdec.cli.exits import EXIT_USAGE
from specdec.cli.interrupts import handling_signals
from specdec.config import add_arguments, from_args
from specdec.engine.config import EngineConfig
from specdec.errors import SpecdecError
from specdec.metrics import prometheus_reader, start_metrics_server
from specdec.models.catalog import DEFAULT_PAIR
from specdec.rpc.session_limits import SessionLimits
from specdec.rpc.serving import SERVICE_MAX_CONCURRENT_RPCS, ServerConfig, install_drain_on_signals
from specdec.security.tls import TlsConfig
from specdec.telemetry import SERVICE_DRAFT, SERVICE_ORCHESTRATOR, SERVICE_TARGET, setup_telemetry
from target_service.config import DEFAULT_PORT as TARGET_PORT

# Only the roles' settings are imported here: a role's service (torch,
# transformers) is imported when that role runs, so `specd --help`, `specd
# generate` and the rest start in a fraction of a second.

log = logging.getLogger("specd")


def register(sub) -> None:
    serve = sub.add_parser("serve", help="run one role (draft, target or orchestrator)")
    roles = serve.add_subparsers(dest="role", required=True)

    draft = roles.add_parser("draft", help="the draft model service")
    add_arguments(draft, ServerConfig,
                  defaults={"port": DRAFT_PORT, "max_concurrent_rpcs": SERVICE_MAX_CONCURRENT_RPCS})
    add_arguments(draft, EngineConfig, defaults={"model": DEFAULT_PAIR.draft, "quantize": "auto"})
    add_arguments(draft, SessionLimits, skip=("max_verify_batch",))
    add_arguments(draft, DrafterConfig)
    add_arguments(draft, TlsConfig)
    draft.set_defaults(func=_serve_draft)

    target = roles.add_parser("target", help="the target model service")
    add_arguments(target, ServerConfig,
                  defaults={"port": TARGET_PORT, "max_concurrent_rpcs": SERVICE_MAX_CONCURRENT_RPCS})
    add_arguments(target, EngineConfig, defaults={"model": DEFAULT_PAIR.target})
    add_arguments(target, SessionLimits)
    add_arguments(target, TlsConfig)
    target.set_defaults(func=_serve_target)

    orch = roles.add_parser("orchestrator", help="the orchestrator clients call")
    add_arguments(orch, ServerConfig, defaults={"port": ORCH_PORT}, skip=("lane_port",))
    add_arguments(orch, OrchestratorConfig)
    add_arguments(orch, HttpConfig)
    add_arguments(orch, TlsConfig, skip=("allowed_callers",))
    orch.set_defaults(func=_serve_orchestrator)


def _run(coro) -> int:
    try:
        eventloop.run(coro)
    except (SpecdecError, ValueError, OSError) as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return 1
    return 0


def _settings(args: argparse.Namespace, role: str, *classes) -> list | None:
    """Each of `classes` filled in from the flags and checked; a value no role
    can run with (a port past 65535, a NaN or negative duration, a
    --default-max-tokens that refuses every request) is one line on stderr
    and None (the caller exits 2), before anything binds or loads."""
    try:
        configs = [from_args(cls, args) for cls in classes]  # ServerConfig checks its ports itself
        for cfg in configs:
            _check_durations(cfg)
            if isinstance(cfg, OrchestratorConfig):
                _check_max_tokens(cfg)
            if isinstance(cfg, (HttpConfig, DrafterConfig)):
                cfg.validate()
    except ValueError as exc:
        print(f"specd serve {role}: error: {exc}", file=sys.stderr)
        return None
    return configs


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_durations(cfg) -> None:
    """A duration (a float setting named *_s or *_ms) must be finite and >= 0:
    a NaN --connect-timeout-s waited for the target forever, a NaN
    --session-ttl-s never expired a session."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and f.name.endswith(("_s", "_ms")) and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{_flag(f.name)} must be a finite number >= 0, got {value}")


def _check_max_tokens(cfg: OrchestratorConfig) -> None:
    """Limits that would refuse every request, each blaming its max_tokens."""
    for name in ("default_max_tokens", "max_tokens_limit"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{_flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.default_max_tokens > cfg.max_tokens_limit:
        raise ValueError(f"--default-max-tokens ({cfg.default_max_tokens}) must be at most --max-tokens-limit "
                         f"({cfg.max_tokens_limit}): requests that leave max_tokens unset would all be refused")


def _valid_engine(engine_cfg: EngineConfig, role: str, *checks) -> bool:
    """The engine settings' checks, a bad one as one line on stderr."""
    try:
        for check in checks:
            check(engine_cfg.quantize)
        engine_cfg.validate()
    except ValueError as exc:
        print(f"specd serve {role}: error: {exc}", file=sys.stderr)
        return False
    return True


def _die_with_launcher() -> None:
    """Stop when `specd up`, which started this role, dies (specdec.processes.die_with_parent)."""
    from specdec.processes import die_with_parent

    die_with_parent()


@contextlib.contextmanager
def _exiting_at_once_on_signals():
    """Until the role serves (`_serve_forever` installs the drain): SIGTERM
    and SIGINT end the process at once. A role importing torch, loading its
    model on the engine thread (minutes for a 7B with its CUDA graphs) or
    waiting for its backends serves nothing yet, so there is nothing to
    drain; and as PID 1 of a container (no init process) a SIGTERM with no
    handler is ignored, so kubelet waited out the whole grace period (45 s)
    to delete a pod still starting. The handlers before are restored after
    (the main thread only installs them)."""
    with handling_signals(_exit_now):
        yield


def _exit_now(signum, _frame) -> None:
    name = signal.Signals(signum).name
    log.warning("%s while starting: exiting at once (nothing is served yet)", name)
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(128 + signum)


def _serve_draft(args: argparse.Namespace) -> int:
    _die_with_launcher()
    settings = _settings(args, "draft", ServerConfig, EngineConfig, SessionLimits, DrafterConfig)
    if settings is None:
        return EXIT_USAGE
    server_cfg, engine_cfg, limits, drafter_cfg = settings
    with _exiting_at_once_on_signals():
        with heap.importing():
            from draft_service.server import build_drafter, start_draft_service

        if not _valid_engine(engine_cfg, "draft"):
            return EXIT_USAGE
        tls = from_args(TlsConfig, args)  # checked before anything binds, by start_model_service

        async def main():
            with role_telemetry("draft", server_cfg) as telemetry:
                service = await start_draft_service(
                    server_cfg, limits, lambda: build_drafter(engine_cfg, drafter_cfg, limits),
                    backend_kind=drafter_cfg.drafter, telemetry=telemetry, tls=tls)
                await _serve_model_service(service, server_cfg, "draft", engine_cfg)

        return _run(main())


def _serve_target(args: argparse.Namespace) -> int:
    _die_with_launcher()
    settings = _settings(args, "target", ServerConfig, EngineConfig, SessionLimits)
    if settings is None:
        return EXIT_USAGE
    server_cfg, engine_cfg, limits = settings
    with _exiting_at_once_on_signals():
        with heap.importing():
            from specdec.engine.quantize import refuse_for_target
            from target_service.server import build_verifier, start_target_service

        if not _valid_engine(engine_cfg, "target", refuse_for_target):
            return EXIT_USAGE
        tls = from_args(TlsConfig, args)

        async def main():
            with role_telemetry("target", server_cfg) as telemetry:
                service = await start_target_service(server_cfg, limits, lambda: build_verifier(engine_cfg, limits),
                                                     telemetry=telemetry, tls=tls)
                await _serve_model_service(service, server_cfg, "target", engine_cfg)

        return _run(main())


def _serve_orchestrator(args: argparse.Namespace) -> int:
    _die_with_launcher()
    settings = _settings(args, "orchestrator", ServerConfig, OrchestratorConfig, HttpConfig)
    if settings is None:
        return EXIT_USAGE
    server_cfg, cfg, http_cfg = settings
    with _exiting_at_once_on_signals():
        with heap.importing():
            from orchestrator.server import start_orchestrator

        tls = from_args(TlsConfig, args)  # so are these

        async def main():
            with role_telemetry("orchestrator", server_cfg) as telemetry:
                orch = await start_orchestrator(server_cfg, cfg, telemetry=telemetry, http=http_cfg, tls=tls)
                http = f", HTTP on {orch.http.host}:{orch.http.port}" if orch.http else ""
                # Draining the orchestrator drains both front doors.
                await _serve_forever(orch, server_cfg, "orchestrator", f"draft={cfg.draft} target={cfg.target}{http}",
                                     models_on_gpu=orch.backends.on_gpus())
                await orch.close_channels()

        return _run(main())


async def _serve_model_service(service, server_cfg: ServerConfig, role: str, engine_cfg: EngineConfig) -> None:
    """A draft or target service from SERVING to its drain's end; raises
    (exit 1) when it drained itself (`_raise_if_failed`)."""
    await _serve_forever(service.running, server_cfg, role, engine_cfg.model,
                         models_on_gpu=engine_cfg.device != "cpu")
    service.servicer.stop_reaper()
    service.worker.shutdown()
    _raise_if_failed(service.running)


def _raise_if_failed(running) -> None:
    """A service that drained itself (its device failed) exits non-zero, so
    that `specd up` or its pod's restartPolicy restarts it."""
    if running.failure is not None:
        raise SpecdecError(f"stopped: {running.failure}")


@contextlib.contextmanager
def role_telemetry(role: str, server_cfg: ServerConfig):
    """The role's Telemetry from the environment (OTEL_*, SPECD_TRACING,
    SPECD_TRACE_FILE), plus the Prometheus endpoint when --metrics-port is
    set; spans still queued are flushed on the way out."""
    service = {"draft": SERVICE_DRAFT, "target": SERVICE_TARGET, "orchestrator": SERVICE_ORCHESTRATOR}[role]
    reader, registry = prometheus_reader() if server_cfg.metrics_port else (None, None)
    telemetry = setup_telemetry(service, metric_readers=[reader] if reader else [])
    server = None
    try:
        if registry is not None:
            server = start_metrics_server(server_cfg.host, server_cfg.metrics_port, registry)
            log.info("metrics on http://%s:%d/metrics", server_cfg.host, server_cfg.metrics_port)
        yield telemetry
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        telemetry.shutdown()


async def _serve_forever(running, server_cfg: ServerConfig, role: str, what: str, models_on_gpu: bool) -> None:
    log.info("%s SERVING on %s:%d (%s)", role, server_cfg.host, running.port, what)
    cpu_latency.hold(server_cfg.cpu_wake_latency_us)
    busy_poll.configure_auto(server_cfg.busy_poll_us, models_on_gpu)
    heap.settle()
    install_drain_on_signals(running, server_cfg.drain_grace_s)
    await running.wait()
    log.info("%s stopped", role)
