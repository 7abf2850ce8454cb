"""`specd soak`: N concurrent mixed streams against the three roles (as child
processes) for T seconds; errors by status, p50/p99 latency, sessions left
open after the drain, and each process's RSS growth.

    specd soak --streams 32 --seconds 60 [--replicas 2] [--out soak.json]

By default the roles serve the tiny random pair (`specdec.bench.tiny_pair`,
built into the model cache on first use, nothing downloaded). The exit code
is 1 when a goal is missed: an unplanned error, or a session left open or
expired on a model service.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from specdec.cli.exits import EXIT_INTERRUPTED
from specdec.cli.flag_types import duration
from specdec.cli.interrupts import interrupted_by_signals
from specdec.cli.model_flags import add_threads


def register(sub) -> None:
    p = sub.add_parser("soak", help="load and soak: concurrent mixed streams against the three roles")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=duration, default=60.0, help="seconds of load (default 60)")
    length.add_argument("--minutes", type=duration, help="minutes of load (instead of --seconds)")
    p.add_argument("--replicas", type=int, default=1, help="target replicas (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    add_threads(p, default=1, applies_to="per model service")
    p.add_argument("--request-timeout-s", type=duration, default=120.0,
                   help="deadline of every request not in the short-deadline fraction (default 120)")
    p.add_argument("--draft-model", default="", help="draft model (default: the tiny random pair's), served with "
                   "the draft service's defaults: its linears int8 where that pays (--quantize auto; "
                   "--env SPECD_QUANTIZE=none keeps its dtype)")
    p.add_argument("--target-model", default="", help="target model (default: the tiny random pair's)")
    p.add_argument("--kill", action="append", default=[], metavar="ROLE@SECONDS",
                   help="kill -9 a role (draft, target0, target1, ...) this far into the load; repeatable")
    p.add_argument("--term", action="append", default=[], metavar="ROLE@SECONDS",
                   help="SIGTERM (drain) a role this far into the load; repeatable")
    p.add_argument("--check-greedy", action="store_true",
                   help="after the drain, compare completed greedy streams with target-only decoding")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the children (e.g. MALLOC_ARENA_MAX=2); repeatable")
    p.add_argument("--logs", default="", help="folder for the roles' logs (default: a temporary one)")
    p.add_argument("--out", default="", help="write the JSON result here")
    p.set_defaults(func=run)


def faults_from_args(args: argparse.Namespace) -> tuple:
    """The faults of --kill and --term (ROLE@SECONDS each) as `Fault`s; a
    malformed one exits with a one-line usage message."""
    from specdec.soak.run import Fault

    faults = []
    for spec, sig in [(s, "SIGKILL") for s in args.kill] + [(s, "SIGTERM") for s in args.term]:
        name, _, at = spec.partition("@")
        try:
            faults.append(Fault(name, float(at), sig))
        except ValueError:
            raise SystemExit(f"specd soak: a fault is ROLE@SECONDS (e.g. target0@20), not {spec!r}") from None
    return tuple(faults)


def run(args: argparse.Namespace) -> int:
    from specdec.soak.load import StreamMix
    from specdec.soak.report import table
    from specdec.soak.run import SoakConfig, run_soak

    if args.streams < 1 or args.replicas < 1:
        print("specd soak: --streams and --replicas must be >= 1", file=sys.stderr)
        return 2
    draft, target = args.draft_model, args.target_model
    if not (draft and target):
        from specdec.bench.tiny_pair import ensure_tiny_pair

        draft_dir, target_dir = ensure_tiny_pair()
        draft, target = draft or str(draft_dir), target or str(target_dir)
    env = dict(item.split("=", 1) for item in args.env if "=" in item)
    load_s = args.minutes * 60 if args.minutes is not None else args.seconds
    cfg = SoakConfig(draft=draft, target=target, streams=args.streams, seconds=load_s, replicas=args.replicas,
                     seed=args.seed, threads=args.threads, faults=faults_from_args(args), check_greedy=args.check_greedy,
                     env=env, mix=StreamMix(request_timeout_s=args.request_timeout_s))
    logs = Path(args.logs or tempfile.mkdtemp(prefix="specd-soak-"))
    print(f"specd soak: logs in {logs}", file=sys.stderr, flush=True)
    try:
        with interrupted_by_signals():  # SIGTERM (`timeout 60 specd soak`) stops the children too
            result = run_soak(cfg, logs)
    except KeyboardInterrupt:
        print("specd soak: interrupted; the services were stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RuntimeError as exc:
        print(f"specd soak: {exc}", file=sys.stderr)
        return 1
    result["command"] = " ".join(["specd", *sys.argv[1:]]) if sys.argv[0].endswith("specd") else None
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    leaked = any(n for n in result["sessions_after_drain"].values()) or any(
        n for n in result["sessions_expired"].values())
    return 1 if result["unplanned_errors"] or leaked else 0
