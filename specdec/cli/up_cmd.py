"""`specd up`: the three roles as three local processes on the default pair.

Fetches the pair first if it is not cached, starts draft and target, waits
until both report SERVING, starts the orchestrator, prints where to connect,
and then supervises the three (`specdec.processes.Supervisor`): a role that
exits is restarted with backoff while the others keep serving; requests in
flight survive it (the orchestrator decodes without the draft, and re-opens
a lost target session by prefilling the history). Ctrl-C (or SIGTERM) stops
all three and waits for them to drain, the orchestrator first (its requests
in flight need draft and target to finish); a second one kills them at once.
A role that exits during start-up still stops everything: that is a
configuration error, not a crash.

`--tls` creates a throwaway CA in a temporary directory (deleted on exit):
the orchestrator then dials draft and target over mutual TLS and serves TLS
at its front doors (docs/security.md). API keys in SPECD_API_KEYS reach the
orchestrator through the environment.
"""
from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from specdec.cli.flag_types import duration, int_in
from specdec.cli.model_flags import add_device, add_dtype, add_role_devices, add_threads
from specdec.config import MAX_PORT
from specdec.engine.config import QUANTIZE_CHOICES
from specdec.models.catalog import DEFAULT_PAIR
from specdec.processes import Backoff, Supervisor, wait_serving
from specdec.trace_file import TRACE_FILE_ENV, default_trace_file


# Ports `specd up` waits on until their role serves: 0 (any free port) would
# leave it nothing to wait on.
SERVED_PORT = int_in(1, MAX_PORT, "specd up waits on it: not 0")

# The HTTP API's port, or -1 (off); not 0: specd up prints where it serves
# (0 printed http://127.0.0.1:0/v1 as where to connect).
HTTP_PORT = int_in(-1, MAX_PORT, "-1: off; not 0: specd up prints where it serves", excluded=(0,))
# The orchestrator's metrics port; the draft's is one above, the target's two.
METRICS_PORT = int_in(0, MAX_PORT - 2, "0: off; the draft's is this + 1, the target's + 2")


def register(sub) -> None:
    p = sub.add_parser("up", help="run draft, target and orchestrator locally (default real pair)")
    p.add_argument("--draft-model", default=DEFAULT_PAIR.draft)
    p.add_argument("--target-model", default=DEFAULT_PAIR.target)
    p.add_argument("--drafter", default="model", choices=("model", "ngram"))
    add_device(p, applies_to="for both model services")
    add_role_devices(p)
    add_dtype(p)
    add_threads(p, applies_to="per model service")
    p.add_argument("--draft-quantize", default="auto", choices=QUANTIZE_CHOICES,
                   help="the draft's linear layers as int8 (CPU only; see docs/benchmarks.md \"An int8 draft\"); "
                        "auto: int8 for a draft on a CPU with VNNI whose hidden size is >= 512 (default auto)")
    p.add_argument("--port", type=SERVED_PORT, default=50051, help="orchestrator port")
    p.add_argument("--http-port", type=HTTP_PORT, default=8000,
                   help="the orchestrator's OpenAI-compatible HTTP API (/v1) port (-1: off; not 0). specd up "
                        "refuses to start when any of its ports is in use")
    p.add_argument("--draft-port", type=SERVED_PORT, default=50052)
    p.add_argument("--target-port", type=SERVED_PORT, default=50053)
    from orchestrator.config import OrchestratorConfig
    from orchestrator.gamma_policy import POLICIES

    p.add_argument("--policy", default=None, choices=POLICIES,
                   help=f"policy choosing num_draft_tokens (default: the orchestrator's own, {OrchestratorConfig.policy})")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="tokens drafted per round (the first round's, "
                                                                   "under adaptive and goodput)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $SPECD_CACHE_DIR or the user cache)")
    p.add_argument("--startup-timeout", type=duration, default=900.0, help="seconds to wait for the models to load")
    p.add_argument("--restart-backoff-s", type=duration, default=1.0,
                   help="first delay before restarting a role that exited (doubles per quick exit, up to 30 s)")
    p.add_argument("--metrics-port", type=METRICS_PORT, default=0,
                   help="Prometheus metrics: the orchestrator on this port, draft +1, target +2 (0: off)")
    p.add_argument("--tls", action="store_true",
                   help="mutual TLS between the roles and TLS at the front doors, with a throwaway local CA "
                        "(its ca.crt is printed: give it to clients as --ca-cert)")
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


def _port_problems(args) -> list[str]:
    """The ports the three roles will bind that are taken (or named twice).
    The roles' gRPC servers bind without SO_REUSEPORT (specdec/rpc/serving.py
    NO_REUSEPORT), so a taken port would fail a role's bind ("cannot bind")
    partway through start-up; this check says so in one clear line before
    anything starts, naming the likely cause: a `specd up` still running in
    another terminal."""
    wanted = [("--port", args.port), ("--draft-port", args.draft_port), ("--target-port", args.target_port)]
    if args.http_port > 0:
        wanted.append(("--http-port", args.http_port))
    if args.metrics_port:
        wanted += [("--metrics-port", args.metrics_port), ("the draft's metrics port (--metrics-port + 1)",
                                                           args.metrics_port + 1),
                   ("the target's metrics port (--metrics-port + 2)", args.metrics_port + 2)]
    problems, named = [], {}
    for flag, port in wanted:
        if port in named:
            problems.append(f"{flag} and {named[port]} are both {port}")
            continue
        named[port] = flag
        problem = _bind_problem(port)
        if problem:
            problems.append(f"{flag} {port} {problem}")
    return problems


def _bind_problem(port: int) -> str:
    """Why 127.0.0.1:PORT cannot be bound ("" if it can). Without
    SO_REUSEPORT, a port some socket listens on (with SO_REUSEPORT or not, on
    127.0.0.1 or on every address) is refused; one only in TIME_WAIT is not
    (SO_REUSEADDR, as the servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is in use on 127.0.0.1 (another `specd up`?)"
            return f"cannot be bound on 127.0.0.1: {exc.strerror}"
    return ""


def _serve_cmd(role: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "specdec.cli.main", "serve", role, *extra]


def run(args: argparse.Namespace) -> int:
    problems = _port_problems(args)
    if problems:
        print("specd up: cannot start: " + "; ".join(problems) + ". Free them, or choose other ports (--port, "
              "--draft-port, --target-port, --http-port, --metrics-port).", file=sys.stderr)
        return 1
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
                  "--device", args.draft_device or args.device, "--quantize", args.draft_quantize, *common,
                  *_metrics_flag(args, 1)]
    target_args = ["--model", args.target_model, "--port", str(args.target_port),
                   "--device", args.target_device or args.device, *common, *_metrics_flag(args, 2)]
    tls, tls_dir, credentials = None, None, None
    if args.tls:
        from specdec.security.local_ca import LocalTls
        from specdec.security.tls import ClientTls

        tls_dir = tempfile.mkdtemp(prefix="specd-tls-")
        tls = LocalTls.create(tls_dir)
        draft_args += tls.flags("draft")
        target_args += tls.flags("target")
        own = tls.files["orchestrator"]  # the services serve health checks to the orchestrator's certificate
        credentials = ClientTls(own.ca, own.cert, own.key).channel_credentials()
    supervisor = Supervisor(Backoff(initial_s=args.restart_backoff_s))
    stop_requested = []

    def request_stop(*_):
        # Installed for SIGINT too: a shell starting `specd up &` leaves SIGINT
        # ignored, and then Python would never raise KeyboardInterrupt.
        stop_requested.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        supervisor.start("target", _serve_cmd("target", target_args), env)
        supervisor.start("draft", _serve_cmd("draft", draft_args), env)
        print("specd up: loading the models (this takes a while on a CPU)...", file=sys.stderr)
        wait_serving(args.target_port, supervisor.processes, args.startup_timeout, credentials)
        wait_serving(args.draft_port, supervisor.processes, args.startup_timeout, credentials)
        supervisor.start("orchestrator", _serve_cmd("orchestrator", [
            "--port", str(args.port), "--host", "127.0.0.1", "--draft", f"127.0.0.1:{args.draft_port}",
            "--target", f"127.0.0.1:{args.target_port}", *(["--policy", args.policy] if args.policy else []),
            "--num-draft-tokens", str(args.num_draft_tokens), "--tokenizer", args.target_model,
            "--http-port", str(args.http_port), *_metrics_flag(args, 0),
            *(tls.flags("orchestrator") if tls else [])]), env)
        wait_serving(args.port, supervisor.processes, 120, credentials)
        scheme, ca_flag, curl_ca = ("https", f" --ca-cert {tls.ca}", f" --cacert {tls.ca}") if tls else ("http", "", "")
        where, curl = f"127.0.0.1:{args.port} (gRPC{', TLS' if tls else ''})", ""
        if args.http_port >= 0:
            where += f" and {scheme}://127.0.0.1:{args.http_port}/v1 (OpenAI-compatible)"
            curl = (f"  curl -s{curl_ca} {scheme}://127.0.0.1:{args.http_port}/v1/completions "
                    "-H 'Content-Type: application/json' "
                    "-d '{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0}'\n")
        print(f"\nspecd up: serving on {where} (draft {args.draft_model}, target {args.target_model}). Try:\n"
              f"  specd generate --server 127.0.0.1:{args.port}{ca_flag} --temperature 0 --stats \"def fibonacci(n):\"\n"
              f"{curl}"
              f"  specd trace show      # its spans, from {env[TRACE_FILE_ENV]}\n"
              "A role that exits is restarted; Ctrl-C stops all three.", file=sys.stderr, flush=True)
        while not stop_requested:
            supervisor.poll()
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("specd up: stopping...", file=sys.stderr)
        # The orchestrator first: its requests in flight finish within its
        # drain grace only while draft and target still serve them. Stopped
        # together, the target went at once and those requests failed.
        supervisor.stop(first=("orchestrator",))
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)
