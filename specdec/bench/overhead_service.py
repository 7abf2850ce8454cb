"""One service of `specd overhead`'s stack in a process of its own, as the
roles are deployed (one process per role): a target (or draft) service over
`overhead_stack.tiny_engine(seed)`, on a free loopback port, which it logs
("listening on 127.0.0.1:PORT", as `specd serve` does). It stops when its
stdin closes (the parent went away) or on SIGTERM.

    python -m specdec.bench.overhead_service --role target --seed 0 [--trace-file F] [--tls-cert C ...] \
        [--busy-poll-us US]
"""
from __future__ import annotations

import argparse
import asyncio
import sys


async def _serve(args: argparse.Namespace) -> None:
    from specdec import busy_poll, heap

    with heap.importing():  # as `specd serve` imports a role
        from draft_service.drafters import ModelDrafter
        from draft_service.server import start_draft_service
        from specdec.bench.overhead_stack import tiny_engine
        from specdec.rpc.session_limits import SessionLimits
        from specdec.rpc.serving import ServerConfig
        from specdec.security.tls import TlsConfig
        from specdec.telemetry import TelemetrySettings, setup_telemetry
        from target_service.server import start_target_service
        from target_service.verifier import Verifier

    busy_poll.configure(args.busy_poll_us)
    limits = SessionLimits()
    telemetry = setup_telemetry(args.role, TelemetrySettings(tracing=bool(args.trace_file),
                                                             trace_file=args.trace_file))
    tls = TlsConfig(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca) if args.tls_cert else None
    cfg = ServerConfig(host="127.0.0.1", port=0)
    engine = tiny_engine(seed=args.seed)
    if args.role == "target":
        verifier = Verifier(engine, limits.max_draft_tokens, limits.max_verify_batch)
        service = await start_target_service(cfg, limits, lambda: verifier, telemetry=telemetry, tls=tls)
    else:
        drafter = ModelDrafter(engine, limits.max_draft_tokens)
        service = await start_draft_service(cfg, limits, lambda: drafter, telemetry=telemetry, tls=tls)
    heap.settle()  # as `specd serve` does once SERVING
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # returns when stdin closes
    finally:
        await service.stop(0)
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> int:
    import logging

    from specdec import eventloop, heap

    with heap.importing():
        import torch

    p = argparse.ArgumentParser(prog="python -m specdec.bench.overhead_service")
    p.add_argument("--role", choices=("target", "draft"), required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--trace-file", default="", help="trace into this JSON-lines file (default: tracing off)")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-ca", default="")
    p.add_argument("--busy-poll-us", type=int, default=0, help="as the roles' flag (specdec/busy_poll.py); 0: off")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    eventloop.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
