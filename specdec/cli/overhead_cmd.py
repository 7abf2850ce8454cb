"""`specd overhead`: what a speculative round spends outside the models,
against bare grpcio calls measured in the same run (specdec/bench/overhead.py),
and, deployed, the orchestrator's own round as a client's Generate meets it
(specdec/bench/orchestrator_round.py); with --hops, only that round, cut
into what each process and each crossing between them took
(specdec/hops.py, specdec/bench/hops_report.py); with --wire, the bytes of a round, the Verify throughput through the
server, and what a sampled round's q's cost each role in either encoding
instead (specdec/bench/wire.py, specdec/bench/q_costs.py); with --end-to-end, tokens/s through
two whole systems with tracing on and off, and spans per generated token
(specdec/bench/tracing_cost.py).

    specd overhead --reps 200 --num-draft-tokens 4 [--tls] [--orchestrator-requests 20]
    specd overhead --hops [--orchestrator-requests 6] [--busy-poll-us 0 | 50000 --busy-poll-roles orchestrator]
    specd overhead --wire [--target qwen2.5-coder-1.5b-instruct]
    specd overhead --end-to-end [--requests 30 --tokens 64] [--random-pair]
    specd overhead --end-to-end --draft qwen2.5-coder-0.5b-instruct --target qwen2.5-coder-1.5b-instruct \
        --requests 6 --tokens 48 --threads 2
"""
from __future__ import annotations

import argparse
import sys

from specdec.cli.flag_types import at_least
from specdec.cli.model_flags import add_device, add_dtype, add_threads

ROLES = ("orchestrator", "draft", "target")

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("overhead", help="per-round wire and loop overhead against bare grpcio calls",
                       description="Loopback, tiny models: a no-op unary call and a round (Verify + Propose of k) "
                       "through the services minus their compute, tracing off and on, each as a ratio to a bare "
                       "grpc.aio unary call measured in the same run.")
    p.add_argument("--reps", type=at_least(1), default=200, help="repetitions of each call; medians are reported")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="k, tokens drafted per round (default 4)")
    p.add_argument("--tls", action="store_true",
                   help="also the round over mutual TLS (a throwaway CA's certificates, as `specd up --tls`), "
                   "and what TLS adds per round")
    p.add_argument("--in-process", action="store_true",
                   help="run both services in the measuring process, on a background event loop (the layout of "
                   "earlier figures), instead of each in a process of its own as deployed")
    p.add_argument("--cpu-wake-latency-us", type=int, default=-1, metavar="US",
                   help="hold the machine's CPU wake-up latency at US microseconds while measuring (0: idle CPUs "
                   "poll; specdec/cpu_latency.py, needs write access to /dev/cpu_dma_latency); default: leave it")
    p.add_argument("--busy-poll-us", type=int, default=-1, metavar="US",
                   help="the roles of --busy-poll-roles poll their event loops instead of sleeping through the end "
                   "of a wait for a reply, up to US microseconds a wait (the roles' --busy-poll-us, "
                   "specdec/busy_poll.py); 0: off; default -1: as the roles' default would on this machine with "
                   "their models on a GPU (on where this process may use 4 CPUs or more: the tiny models here "
                   "stand in for a GPU deployment's)")
    p.add_argument("--busy-poll-roles", nargs="+", choices=ROLES, default=list(ROLES), metavar="ROLE",
                   help="which roles poll with --busy-poll-us: orchestrator (this process's clients too), draft, "
                   "target (default: all three; with --in-process the services share this process's setting)")
    p.add_argument("--orchestrator-requests", type=int, default=None, metavar="N",
                   help="Generate requests of each kind for the orchestrator's own round (deployed layout only; "
                   "default: --reps / 10, at least 2)")
    add_threads(p, default=None, default_text="1; with --wire 2, as the real target's forward passes use; with "
                "--end-to-end torch's default")
    p.add_argument("--hops", action="store_true",
                   help="only the orchestrator's own round, cut into its hops: each process of the stack records "
                        "its events of a round (specdec/hops.py), and the table says what each process and each "
                        "crossing between them took (--orchestrator-requests requests of each kind, default 6)")
    wire = p.add_argument_group("--wire: bytes per round and Verify throughput")
    wire.add_argument("--wire", action="store_true",
                      help="print the bytes of one round (vocab 151936, greedy and T=0.7) per emitted token, and "
                      "the Verify throughput with 1/4/16 sessions per call, instead of the overhead")
    wire.add_argument("--acceptance", type=float, default=0.8, help="acceptance rate for bytes per token (0.8)")
    wire.add_argument("--target", default="", help="a cached model whose Verify throughput to add "
                      "(e.g. qwen2.5-coder-1.5b-instruct); with --end-to-end, the target (with --draft)")
    add_dtype(wire, default=None, applies_to="for --target", default_text="bfloat16; with --end-to-end auto")
    e2e = p.add_argument_group("--end-to-end: tokens/s with tracing on vs off, spans per token")
    e2e.add_argument("--end-to-end", action="store_true",
                     help="two whole in-process systems (target, draft, orchestrator) over the same engines, one "
                     "traced as `specd up` traces, one with SPECD_TRACING=off; greedy requests alternate between them; "
                     "prints the median tokens/s of each, spans per generated token and the cost of one span")
    e2e.add_argument("--requests", type=int, default=30, help="requests per mode (default 30)")
    e2e.add_argument("--tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    e2e.add_argument("--draft", default="", help="draft model (with --target; default: the tiny pair)")
    e2e.add_argument("--random-pair", action="store_true",
                     help="instead of the tiny pair, the tests' 2-layer random target and a perturbed copy as draft "
                     "(the pair of the former benchmarks/tracing_overhead.py)")
    add_device(e2e, applies_to="for --draft/--target")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.bench.machine_load import LoadWatch

    watch = LoadWatch().start()
    rc = _run(args)
    load = watch.stop()
    if rc == 0 and load is not None:  # figures taken beside other work are not a quiet run's
        print("\n" + load.line())
    return rc


def _run(args: argparse.Namespace) -> int:
    import torch

    from specdec import cpu_latency, eventloop
    from specdec.bench import orchestrator_round
    from specdec.bench.overhead import measure
    from specdec.bench.overhead_report import report

    if args.end_to_end:
        return _end_to_end(args)
    if args.wire:
        from specdec.bench.wire import run as wire

        threads = args.threads or 2
        torch.set_num_threads(threads)
        print(wire(args.num_draft_tokens, args.acceptance, args.reps, args.target, args.dtype or "bfloat16", threads))
        from specdec.bench import q_costs

        print("\n" + q_costs.report(q_costs.measure(args.num_draft_tokens, reps=args.reps * 5), args.num_draft_tokens))
        return 0
    if args.orchestrator_requests is not None and args.orchestrator_requests < 1:
        print("specd: error: --orchestrator-requests must be at least 1", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads or 1)
    if args.busy_poll_us < -1:
        print("specd: error: --busy-poll-us must be -1 (auto), 0 (off) or more", file=sys.stderr)
        return 1
    from specdec import busy_poll

    # The tiny models here stand in for a GPU deployment's: auto chooses as the roles would there.
    poll_us, why = busy_poll.choose(args.busy_poll_us, models_on_gpu=True)
    if args.busy_poll_us < 0:
        why += ", as for a GPU deployment: the tiny models here stand in for its models"
    polls = _busy_poll(poll_us, args.busy_poll_roles)
    note = _busy_poll_note(poll_us, why, args.busy_poll_roles)
    if args.hops:
        if args.tls or args.in_process or args.cpu_wake_latency_us >= 0:
            print("specd: error: --hops measures the deployed orchestrator's round in plaintext: it takes "
                  "neither --tls, --in-process nor --cpu-wake-latency-us", file=sys.stderr)
            return 1
        return _hops(args, polls, note)
    held = cpu_latency.hold(args.cpu_wake_latency_us)
    if args.cpu_wake_latency_us >= 0 and not held:
        print(f"specd overhead: cannot hold the CPU wake-up latency at {args.cpu_wake_latency_us} us "
              f"(see the log)", file=sys.stderr)
        return 1
    figures = eventloop.run(measure(args.reps, args.num_draft_tokens, tls=args.tls, in_process=args.in_process,
                                    threads=args.threads or 1, busy_poll_us=polls))
    print(report(figures, args.reps))
    if not args.in_process:  # the orchestrator's own round: deployed, as clients call it
        print("\n" + "\n".join(orchestrator_round.report_lines(_orchestrator_rounds(args, polls=polls))))
    print(note)
    if held:
        print(f"\nThe CPU wake-up latency was held at <= {args.cpu_wake_latency_us} us ({cpu_latency.DEVICE}) "
              "throughout, for every process of the run.")
    return 0


def _orchestrator_rounds(args: argparse.Namespace, default_requests: int | None = None, hops_dir=None,
                         polls: dict[str, int] | None = None) -> list:
    import tempfile
    from pathlib import Path

    from specdec import eventloop
    from specdec.bench import orchestrator_round

    requests = args.orchestrator_requests if args.orchestrator_requests is not None else (
        default_requests if default_requests is not None else max(2, args.reps // 10))
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as log_dir:
        return eventloop.run(orchestrator_round.measure(requests, args.num_draft_tokens, args.threads or 1,
                                                        Path(log_dir), hops_dir=hops_dir, busy_poll_us=polls))


def _hops(args: argparse.Namespace, polls: dict[str, int], note: str) -> int:
    import tempfile
    from pathlib import Path

    from specdec.bench import hops_report, orchestrator_round

    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as hops_dir:
        rounds = _orchestrator_rounds(args, default_requests=6, hops_dir=Path(hops_dir), polls=polls)
        kinds = hops_report.rounds(hops_report.read_events(Path(hops_dir)), skip_first_request=True)
    print("\n".join(orchestrator_round.report_lines(rounds)))
    print("\n" + "\n".join(hops_report.report_lines(kinds)))
    print(note)
    return 0


def _busy_poll(max_us: int, roles: list[str]) -> dict[str, int]:
    """Each role's --busy-poll-us; this process (the orchestrator's clients
    in the emulated round) polls with the orchestrator."""
    from specdec import busy_poll

    polls = {role: max_us if role in roles else 0 for role in ROLES}
    busy_poll.configure(polls["orchestrator"])
    return polls


def _busy_poll_note(poll_us: int, why: str, roles: list[str]) -> str:
    """What the run's busy polling was, and why (printed under its tables)."""
    if not poll_us:
        return f"\nBusy polling: off ({why})."
    return (f"\nBusy polling ({why}: up to {poll_us} us a wait): "
            f"{', '.join(roles)} polled the end of each wait for a reply instead of sleeping through it.")


def _end_to_end(args: argparse.Namespace) -> int:
    import sys

    from specdec.bench.tracing_cost import load_pair, measure, random_pair, report
    from specdec.errors import SpecdecError

    if bool(args.draft) != bool(args.target) or (args.random_pair and args.target):
        print("specd: error: --end-to-end takes both --draft and --target, or neither (the tiny pair, or "
              "--random-pair)", file=sys.stderr)
        return 1
    if args.requests < 1 or args.tokens < 1:
        print("specd: error: --requests and --tokens must be at least 1", file=sys.stderr)
        return 1
    try:
        if args.random_pair:
            if args.threads:
                import torch

                torch.set_num_threads(args.threads)
            target, draft, tokenizer, prompts = random_pair()
        else:
            target, draft, tokenizer, prompts = load_pair(args.target, args.draft, args.dtype or "auto",
                                                          args.threads or 0, args.device)
    except (SpecdecError, ValueError, OSError) as error:
        print(f"specd: error: {error}", file=sys.stderr)
        return 1
    pair = (f"{args.draft} -> {args.target}" if args.target else "tiny random pair (2 layers, perturbed draft)"
            if args.random_pair else "tiny pair (specdec.bench.tiny_pair, float32)")
    print(report(measure(target, draft, tokenizer, prompts, pair=pair, requests=args.requests, tokens=args.tokens,
                         num_draft_tokens=args.num_draft_tokens)))
    return 0
