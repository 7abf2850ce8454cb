"""`specd overhead`: what a speculative round spends outside the models,
against bare grpcio calls measured in the same run (specdec/bench/overhead.py).

    specd overhead --reps 200 --num-draft-tokens 4
"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("overhead", help="per-round wire and loop overhead against bare grpcio calls",
                       description="Loopback, tiny models: a no-op unary call and a round (Verify + Propose of k) "
                       "through the services minus their compute, tracing off and on, each as a ratio to a bare "
                       "grpc.aio unary call measured in the same run.")
    p.add_argument("--reps", type=int, default=200, help="repetitions of each call; medians are reported")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="k, tokens drafted per round (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the tiny models (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from specdec import eventloop
    from specdec.bench.overhead import measure, report

    torch.set_num_threads(args.threads)
    figures = eventloop.run(measure(args.reps, args.num_draft_tokens))
    print(report(figures, args.reps))
    return 0
