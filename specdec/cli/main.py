"""`specd`: serve a role, run all three locally, generate, fetch models.

    specd models fetch | list
    specd serve draft|target|orchestrator [flags]
    specd up                  # the default real pair, three local processes
    specd generate PROMPT     # stream from an orchestrator
    specd trace list | show   # traced requests from the local trace file
    specd bench [--quick]     # side-by-side benchmark, results folder + docs figures
    specd proxy               # a TCP proxy adding network latency (tests, benchmarks)
    specd steps MODEL...      # step costs against the memory-bandwidth floor
    specd overhead            # per-round wire and loop overhead vs bare grpcio
    specd identity            # greedy identity of speculative vs target-only, the tie diagnosis
    specd soak                # load and soak: concurrent mixed streams, sessions, RSS growth
"""
from __future__ import annotations

import os

# Idle OpenMP threads otherwise busy-wait after every parallel region; when the
# draft and target share CPU cores (specd up, a CPU node) each one's spinning
# threads starve the other: measured on 2 cores, 0.6 tok/s instead of 5.4.
# Set before torch loads; a value the user exported wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from specdec.cli import (bench_cmd, generate_cmd, identity_cmd, models_cmd, overhead_cmd, proxy_cmd,  # noqa: E402
                         serve_cmd, soak_cmd, steps_cmd, trace_cmd, up_cmd)
from specdec.cli.exits import EXIT_USAGE  # noqa: E402
from specdec.rpc import grpc_io  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Distributed speculative decoding over gRPC.")
    parser.add_argument("--log-level", default="INFO", help="logging level of server roles (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    models_cmd.register(sub)
    serve_cmd.register(sub)
    up_cmd.register(sub)
    generate_cmd.register(sub)
    trace_cmd.register(sub)
    bench_cmd.register(sub)
    proxy_cmd.register(sub)
    steps_cmd.register(sub)
    overhead_cmd.register(sub)
    identity_cmd.register(sub)
    soak_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        grpc_io.chosen()
    except ValueError as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # A warning per malformed member of a client's `baggage` header: 181 lines
    # for one 8 KB header, from any client, about input nobody here can fix.
    logging.getLogger("opentelemetry.baggage").setLevel(logging.ERROR)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
