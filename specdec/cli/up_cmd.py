"""`specd up`: the three roles as three local processes on the default pair.

Fetches the pair first if it is not cached, starts draft and target, waits
until both report SERVING, starts the orchestrator, prints where to connect,
and on Ctrl-C (or SIGTERM) stops all three and waits for them.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.trace_file import TRACE_FILE_ENV, default_trace_file


def register(sub) -> None:
    p = sub.add_parser("up", help="run draft, target and orchestrator locally (default real pair)")
    p.add_argument("--draft-model", default=DEFAULT_DRAFT)
    p.add_argument("--target-model", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default="model", choices=("model", "ngram"))
    p.add_argument("--device", default="cpu", help="device of both model services (or use --draft-device/--target-device)")
    p.add_argument("--draft-device", default=None)
    p.add_argument("--target-device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per model service (0: torch default)")
    p.add_argument("--port", type=int, default=50051, help="orchestrator port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the orchestrator's OpenAI-compatible HTTP API (/v1) port (-1: off)")
    p.add_argument("--draft-port", type=int, default=50052)
    p.add_argument("--target-port", type=int, default=50053)
    p.add_argument("--policy", default="fixed")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $SPECD_CACHE_DIR or the user cache)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the models to load")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus metrics: the orchestrator on this port, draft +1, target +2 (0: off)")
    p.set_defaults(func=run)


def _fetch_missing(args) -> None:
    from specdec.models.fetch import fetch

    for name in {args.draft_model, args.target_model} - ({args.draft_model} if args.drafter == "ngram" else set()):
        if os.path.exists(name) or name.startswith("synth:"):  # synth: built at start-up
            continue
        fetch(name, cache_dir=args.cache_dir)


def _metrics_flag(args, offset: int) -> list[str]:
    """Each role its own metrics port; an explicit 0 also overrides an
    exported SPECD_METRICS_PORT, which the three would otherwise share."""
    return ["--metrics-port", str(args.metrics_port + offset if args.metrics_port else 0)]


def _spawn(role: str, extra: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdec.cli.main", "serve", role, *extra]
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def wait_serving(port: int, procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until the server on `port` reports SERVING; fail early if any of
    `procs` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a service exited during start-up (see its log above)")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"the service on port {port} was not SERVING after {timeout_s:.0f} s")


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM every process (they drain), then SIGKILL what is left after grace_s."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def run(args: argparse.Namespace) -> int:
    try:
        _fetch_missing(args)
    except Exception as exc:  # noqa: BLE001 - one clear line for the user
        print(f"specd up: cannot fetch the models: {exc}", file=sys.stderr)
        return 1
    env = dict(os.environ)
    # One trace file for the three roles, where `specd trace` looks by default.
    env.setdefault(TRACE_FILE_ENV, str(default_trace_file()))
    # Each role names itself (specdec-draft, ...): one exported name would merge the three.
    env.pop("OTEL_SERVICE_NAME", None)
    if args.cache_dir:
        env["SPECD_CACHE_DIR"] = args.cache_dir
    common = ["--dtype", args.dtype, "--threads", str(args.threads), "--host", "127.0.0.1"]
    draft_args = ["--model", args.draft_model, "--drafter", args.drafter, "--port", str(args.draft_port),
                  "--device", args.draft_device or args.device, *common, *_metrics_flag(args, 1)]
    target_args = ["--model", args.target_model, "--port", str(args.target_port),
                   "--device", args.target_device or args.device, *common, *_metrics_flag(args, 2)]
    procs: list[subprocess.Popen] = []
    stop_requested = []

    def request_stop(*_):
        # Installed for SIGINT too: a shell starting `specd up &` leaves SIGINT
        # ignored, and then Python would never raise KeyboardInterrupt.
        stop_requested.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        procs.append(_spawn("target", target_args, env))
        procs.append(_spawn("draft", draft_args, env))
        print("specd up: loading the models (this takes a while on a CPU)...", file=sys.stderr)
        wait_serving(args.target_port, procs, args.startup_timeout)
        wait_serving(args.draft_port, procs, args.startup_timeout)
        procs.append(_spawn("orchestrator", [
            "--port", str(args.port), "--host", "127.0.0.1", "--draft", f"127.0.0.1:{args.draft_port}",
            "--target", f"127.0.0.1:{args.target_port}", "--policy", args.policy,
            "--num-draft-tokens", str(args.k), "--tokenizer", args.target_model, "--http-port", str(args.http_port),
            *_metrics_flag(args, 0)], env))
        wait_serving(args.port, procs, 120)
        where, curl = f"127.0.0.1:{args.port} (gRPC)", ""
        if args.http_port >= 0:
            where += f" and http://127.0.0.1:{args.http_port}/v1 (OpenAI-compatible)"
            curl = (f"  curl -s http://127.0.0.1:{args.http_port}/v1/completions -H 'Content-Type: application/json' "
                    "-d '{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0}'\n")
        print(f"\nspecd up: serving on {where} (draft {args.draft_model}, target {args.target_model}). Try:\n"
              f"  specd generate --server 127.0.0.1:{args.port} --temperature 0 --stats \"def fibonacci(n):\"\n"
              f"{curl}"
              f"  specd trace show      # its spans, from {env[TRACE_FILE_ENV]}\n"
              "Ctrl-C stops all three.", file=sys.stderr, flush=True)
        while not stop_requested and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 0 if stop_requested else 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("specd up: stopping...", file=sys.stderr)
        stop_processes(procs)
