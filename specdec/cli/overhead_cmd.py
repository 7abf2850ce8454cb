"""`specd overhead`: what a speculative round spends outside the models,
against bare grpcio calls measured in the same run (specdec/bench/overhead.py);
with --wire, the bytes of a round and the Verify throughput through the
server instead (specdec/bench/wire.py).

    specd overhead --reps 200 --num-draft-tokens 4 [--tls]
    specd overhead --wire [--target qwen2.5-coder-1.5b-instruct]
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
    p.add_argument("--tls", action="store_true",
                   help="also the round over mutual TLS (a throwaway CA's certificates, as `specd up --tls`), "
                   "and what TLS adds per round")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default 1; with --wire 2, as the real target's forward passes use)")
    wire = p.add_argument_group("--wire: bytes per round and Verify throughput")
    wire.add_argument("--wire", action="store_true",
                      help="print the bytes of one round (vocab 151936, greedy and T=0.7) per emitted token, and "
                      "the Verify throughput with 1/4/16 sessions per call, instead of the overhead")
    wire.add_argument("--acceptance", type=float, default=0.8, help="acceptance rate for bytes per token (0.8)")
    wire.add_argument("--target", default="", help="a cached model whose Verify throughput to add "
                      "(e.g. qwen2.5-coder-1.5b-instruct)")
    wire.add_argument("--dtype", default="bfloat16", help="dtype of --target (bfloat16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from specdec import eventloop
    from specdec.bench.overhead import measure, report

    if args.wire:
        from specdec.bench.wire import run as wire

        threads = args.threads or 2
        torch.set_num_threads(threads)
        print(wire(args.num_draft_tokens, args.acceptance, args.reps, args.target, args.dtype, threads))
        return 0
    torch.set_num_threads(args.threads or 1)
    figures = eventloop.run(measure(args.reps, args.num_draft_tokens, tls=args.tls))
    print(report(figures, args.reps))
    return 0
