"""`specd proxy`: a TCP proxy that adds latency, jitter and a bandwidth cap
in front of a service (see specdec/latency_proxy.py)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from specdec.cli.exits import EXIT_ERROR, EXIT_USAGE
from specdec.cli.flag_types import non_negative, port


def register(sub) -> None:
    p = sub.add_parser("proxy", help="forward a port to a service, adding network latency",
                       description="Forward HOST:LISTEN-PORT to UPSTREAM, adding a one-way delay in each "
                                   "direction (a round trip gains 2 x --delay-ms: for an RTT of X ms pass "
                                   "--delay-ms X/2), uniform jitter in [0, --jitter-ms] that never reorders "
                                   "data, and an optional bandwidth cap per direction. Runs until SIGINT or "
                                   "SIGTERM; prints the address it listens on.")
    p.add_argument("--listen-port", type=port, default=0, help="port to listen on (default 0: any free port)")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the service to forward to")
    p.add_argument("--delay-ms", type=non_negative, default=0.0, help="ONE-WAY delay added in each direction, ms")
    p.add_argument("--jitter-ms", type=non_negative, default=0.0, help="extra delay, uniform in [0, J] ms, order kept")
    p.add_argument("--bandwidth-mbps", type=non_negative, default=0.0,
                   help="cap of each direction, megabits per second (default 0: unlimited)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.latency_proxy import LatencyProxy

    try:
        proxy = LatencyProxy(args.upstream, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms,
                             bandwidth_mbps=args.bandwidth_mbps, host=args.host, port=args.listen_port)
    except ValueError as exc:  # a flag's value: the upstream, a delay, the bandwidth
        print(f"specd proxy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        proxy.start()
    except (ValueError, OSError) as exc:
        print(f"specd proxy: {exc}", file=sys.stderr)
        return EXIT_ERROR
    done = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(proxy.address, flush=True)
        bandwidth = f"{args.bandwidth_mbps:g} Mbit/s" if args.bandwidth_mbps > 0 else "unlimited bandwidth"
        print(f"specd proxy: {proxy.address} -> {args.upstream}: one-way delay {args.delay_ms:g} ms "
              f"(round trip +{2 * args.delay_ms:g} ms), jitter 0-{args.jitter_ms:g} ms, {bandwidth}",
              file=sys.stderr, flush=True)
        while not done.wait(1.0):
            pass
    finally:
        proxy.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"specd proxy: stopped (forwarded {proxy.bytes_up} bytes up, {proxy.bytes_down} down)",
          file=sys.stderr)
    return 0
