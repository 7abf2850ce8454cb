"""`specd bench`: target-only, HF transformers and specdec side by side.

    specd bench --quick                       # a few minutes on a CPU, default real pair
    specd bench                               # the full sweep (hours on a CPU)
    specd bench --pair tiny --quick           # tiny random pair, token-id prompts
    specd bench --rtt-ms 0 2 10 50            # ... through latency proxies

One invocation starts the target, draft and orchestrator as child processes
(logs in the results folder), loads the target (and the draft) in this
process for the HF baselines, runs every config interleaved, stops the
services, and writes runs.jsonl, requests.jsonl, summary.md and PNG plots
(`bench_results`). The flags are resolved and checked in `bench_options`.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

from specdec.bench.runner import BASELINES, HF_ASSISTED, HF_KINDS, routes
from specdec.cli.bench_options import SYNTH_PAIRS, UsageError, build_prompts, resolve, use_tiny_pair
from specdec.cli.bench_results import write_results
from specdec.cli.flag_types import duration
from specdec.cli.interrupts import interrupted_by_signals
from specdec.cli.model_flags import add_device, add_dtype, add_role_devices, add_threads
from specdec.engine.config import AUTO_ON_OFF, QUANTIZE_CHOICES
from specdec.models.catalog import DEFAULT_PAIR


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark target-only, HF transformers and specdec side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models and devices")
    g.add_argument("--pair", choices=("default", "tiny", *SYNTH_PAIRS), default="default",
                   help="default: --draft/--target (the real pair unless given); tiny: a small random pair "
                        "with token-id prompts (specdec.bench.tiny_pair); synth-D-T: random-weight Qwen2.5 "
                        "models of those sizes built in place (real step costs, no real acceptance: read the "
                        "projected speedups)")
    g.add_argument("--draft", default=None, help=f"draft: catalog name or model directory (default {DEFAULT_PAIR.draft})")
    g.add_argument("--target", default=None, help=f"target: catalog name or model directory (default {DEFAULT_PAIR.target})")
    add_device(g, applies_to="for both roles and the HF baselines")
    add_role_devices(g)
    add_dtype(g)
    g.add_argument("--draft-vocab", type=int, nargs="+", default=[0], metavar="N",
                   help="the draft service's output head over its N most frequent ids (specd models rank-vocab; "
                        "0: the full head). Several sizes: one draft service each, and every specdec config runs "
                        "against each head, named NAME/vN (NAME alone: the full head)")
    g.add_argument("--draft-min-confidence", type=float, nargs="+", default=[], metavar="P",
                   help="each round's drafting ends once the product of the draft's probabilities of its drafts "
                        "is below P (a per-request option; 0: never). Several values: every specdec config runs "
                        "with each, named NAME/cP (default: the orchestrator's default)")
    g.add_argument("--draft-quantize", default="auto", choices=QUANTIZE_CHOICES,
                   help="the draft's linear layers as int8 (CPU only; engine/quantize.py), in the draft "
                        "service and in HF assisted generation alike, so both speculate with the same draft; "
                        "auto: int8 for a draft on a CPU with VNNI whose hidden size is >= 512, as the draft "
                        "service chooses (default auto)")
    g.add_argument("--packed-linears", default="auto", choices=AUTO_ON_OFF,
                   help="the model services' bf16 linears with weights pre-packed for oneDNN (CPU; "
                        "engine/packed_linear.py; the same products, bit for bit). The HF baselines run "
                        "transformers as it comes, F.linear (default auto)")
    g.add_argument("--hf-packed-linears", default="off", choices=("auto", "off"),
                   help="auto: the HF baselines' bf16 linears on pre-packed weights too, a what-if that shows how "
                        "much of a lead over HF is the kernel (default off: transformers as it comes)")
    g.add_argument("--batcher", nargs="+", choices=("on", "off"), default=["on"],
                   help="the orchestrator's verify batcher. 'on off': the service configs that run at "
                        "concurrency > 1 also run there with it off (one more orchestrator), named NAME/batcher-off")
    g.add_argument("--speculation-gate", nargs="+", choices=("on", "off"), default=["on"],
                   help="the orchestrator's speculation gate (orchestrator/speculation_gate.py: under concurrency, "
                        "speculate or decode plainly, whichever it measures faster). 'on off': the specdec configs "
                        "that run at concurrency > 1 also run there with it off, named NAME/gate-off")
    add_threads(g, applies_to="per model service and for the HF baselines")
    g = p.add_argument_group("what to run (--quick sets small defaults; explicit flags win)")
    g.add_argument("--quick", action="store_true", help="a few minutes on a CPU: few prompts, short outputs, "
                                                        "one k, concurrency 1 and 4, one repeat")
    g.add_argument("--max-tokens", type=int, default=None, help="tokens per request (full 128, quick 16)")
    g.add_argument("--prompts", type=int, default=None, help="HumanEval prompts (full 10, quick 1)")
    g.add_argument("--chat-prompts", type=int, default=None, help="chat prompts (full 4, quick 1; at most 8)")
    g.add_argument("--token-prompts", type=int, default=None,
                   help="random token-id prompts instead of text (for models without a tokenizer; "
                        "the tiny pair's count)")
    g.add_argument("--token-prompt-len", type=int, default=24, help="length of each random token-id prompt")
    g.add_argument("--num-draft-tokens", type=int, nargs="+", default=None,
                   help="num_draft_tokens values of the fixed policy, one config each (full 2-6, quick 4)")
    g.add_argument("--policies", nargs="+", default=None,
                   help="specdec policies: fixed (one config per k), adaptive, goodput, NAME-pipeline for "
                        "pipelined drafting; none for baselines only (default: fixed adaptive goodput "
                        "goodput-pipeline)")
    g.add_argument("--baselines", nargs="*", default=None, choices=BASELINES,
                   help="service = target-only through the services; hf = transformers generate; "
                        "hf-assisted = generate(assistant_model=draft) (default: all three)")
    g.add_argument("--temperatures", type=float, nargs="+", default=None, help="default: 0 0.7")
    g.add_argument("--seed", type=int, default=1234, help="sampled requests use seed + prompt index")
    g.add_argument("--concurrency", type=int, nargs="+", default=None, help="concurrent client streams (full 1 4 8, "
                                                                            "quick 1 4)")
    g.add_argument("--concurrency-configs", nargs="+", default=None,
                   help="configs (by name, e.g. target-only fixed-k4 adaptive) also run at concurrency > 1 "
                        "(full: every service config; quick: target-only and the last specdec config)")
    g.add_argument("--repeats", type=int, default=None, help="interleaved repeats; medians are reported (full 3)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one short unrecorded request per path first")
    g = p.add_argument_group("network (latency proxies between the orchestrator and each service)")
    g.add_argument("--rtt-ms", type=float, nargs="+", default=None,
                   help="round-trip times to sweep, each for both services (e.g. 0 2 10 50)")
    g.add_argument("--draft-rtt-ms", type=float, default=None, help="one condition: RTT to the draft")
    g.add_argument("--target-rtt-ms", type=float, default=None, help="one condition: RTT to the target")
    g.add_argument("--jitter-ms", type=float, default=0.0, help="delay jitter of the proxies")
    g.add_argument("--assume-acceptance", type=float, nargs="+", default=[0.7, 0.8, 0.85],
                   help="acceptances at which to project the speedup from the measured round costs "
                        "(labelled projected; default 0.7 0.8 0.85)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="results folder (default bench-results/<UTC timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--startup-timeout", type=duration, default=900.0, help="seconds to wait for the models to load")
    g.add_argument("--request-timeout", type=duration, default=3600.0, help="deadline of each request, seconds")
    p.set_defaults(func=run)


def _command_line(args: argparse.Namespace) -> str:
    argv = sys.argv[1:]
    if "bench" in argv:
        return shlex.join(["specd", *argv])
    parts = ["specd", "bench"]  # called as a function: rebuild from the parsed flags
    for key, value in sorted(vars(args).items()):
        if key in ("func", "command", "log_level") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


# ---------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    started = time.time()
    try:
        o = resolve(args)
        for note in o["notes"]:
            _log(f"specd bench: {note}")
        if args.pair == "tiny":
            use_tiny_pair(o)
        out_dir = Path(args.out or Path("bench-results") / dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
        if out_dir.exists() and any(out_dir.iterdir()):
            raise UsageError(f"the results folder {out_dir} is not empty: pick another --out")
        prompts = build_prompts(o, args.pair, args.seed)
    except UsageError as exc:
        print(f"specd bench: error: {exc}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    return _run(args, o, prompts, out_dir, started)


def _run(args, o: dict, prompts: list, out_dir: Path, started: float) -> int:
    from specdec.bench.machine import describe_machine
    from specdec.bench.machine_load import LoadWatch

    machine, command = describe_machine(), _command_line(args)
    watch = LoadWatch().start()
    runner, interrupted, rc = _measure(args, o, _plan(o, prompts), out_dir)
    load = watch.stop()
    if load is not None:  # what else the machine ran meanwhile, beside the machine's description
        machine["other_load"] = load.line()
        if load.busy:
            _log(f"specd bench: {load.line()}")
    if runner is None or not runner.records:
        _log(f"specd bench: no results; logs in {out_dir}")
        return rc or 1
    write_results(args, o, prompts, runner, interrupted, machine, command, out_dir, started)
    return rc


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _plan(o: dict, prompts: list):
    from specdec.bench.runner import Plan

    return Plan(configs=o["configs"], prompts=prompts, temperatures=o["temperatures"], concurrency=o["concurrency"],
                repeats=o["repeats"], conditions=o["conditions"], max_tokens=o["max_tokens"],
                concurrency_configs=o["concurrency_configs"])


def _measure(args, o: dict, plan, out_dir: Path) -> tuple:
    """Run the plan, each request recorded to requests.jsonl as it ends.
    Whatever happens, the services are stopped and torch's thread count and
    the signal handlers are restored. Returns (runner or None, interrupted,
    exit code)."""
    import torch

    from specdec.bench.runner import Runner

    services = _service_set(args, o, out_dir)
    runner, interrupted, rc = None, False, 0
    threads_before = torch.get_num_threads()
    with _recording(out_dir / "requests.jsonl") as on_record, interrupted_by_signals():
        try:
            hf = _start(services, args, o, out_dir)
            if hf is not None:  # hf-static: one cache shape for the warm-up and every request
                hf.static_cache_len = max(len(p.token_ids) for p in plan.prompts) + plan.max_tokens
            runner = Runner(plan, services=services, hf=hf, request_timeout_s=args.request_timeout,
                            progress=not args.no_progress, on_record=on_record, log=_log)
            _warm_up_and_run(runner, plan, args.warmup)
        except KeyboardInterrupt:
            interrupted, rc = True, 130
            _log("specd bench: interrupted; stopping the services and writing what finished...")
        except RuntimeError as exc:
            rc = 1
            _log(f"specd bench: {exc}")
        finally:
            if services is not None:
                services.stop()
            torch.set_num_threads(threads_before)
    return runner, interrupted, rc


def _service_set(args, o: dict, out_dir: Path):
    """The services as child processes (not started yet): the target, one
    draft per draft head, one orchestrator per route; None when no config
    uses them."""
    if not o["uses_services"]:
        return None
    from specdec.bench.services import ServiceOptions, ServiceSet

    return ServiceSet(ServiceOptions(draft=o["draft_dir"], target=o["target_dir"], draft_device=o["draft_device"],
                                     target_device=o["target_device"], dtype=args.dtype, threads=args.threads,
                                     tokenizer=o["target_dir"], startup_timeout_s=args.startup_timeout,
                                     draft_vocabs=tuple(o["draft_vocabs"]), draft_quantize=o["draft_quantize"],
                                     packed_linears=args.packed_linears),
                      out_dir / "logs")


@contextlib.contextmanager
def _recording(path: Path):
    """A callback that appends one JSON line per request to `path`."""
    with open(path, "w") as f:
        def on_record(record: dict) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()

        yield on_record


def _start(services, args, o: dict, out_dir: Path):
    """Start the services' models, load the HF baselines in this process
    while they load, then bring the services up: proxies (under the first
    network condition) and the orchestrators (one per route). Returns the HF baselines, None
    when no config needs them."""
    if services is not None:
        _log(f"specd bench: starting the services (logs in {out_dir / 'logs'})...")
        services.start_models()
    hf = _load_hf_baselines(args, o)
    if services is not None:
        services.wait_models()
        first = o["conditions"][0]
        if any(c.proxied for c in o["conditions"]):
            services.start_proxies(first.one_way_delays_ms(), first.jitter_ms)
        services.start_orchestrator(routes=routes(o["configs"]))
        (out_dir / "services.json").write_text(json.dumps(services.describe(), indent=2) + "\n")
    return hf


def _load_hf_baselines(args, o: dict):
    hf_kinds = {c.kind for c in o["configs"]} & set(HF_KINDS)
    if not hf_kinds:
        return None
    from specdec.bench.hf_baselines import HFBaselines
    from specdec.engine.config import EngineConfig

    _log("specd bench: loading the HF baselines in this process...")
    target_cfg = EngineConfig(model=o["target_dir"], device=o["target_device"], dtype=args.dtype, threads=args.threads)
    draft_cfg = (EngineConfig(model=o["draft_dir"], device=o["draft_device"], dtype=args.dtype, threads=args.threads,
                              quantize=o["draft_quantize"])
                 if HF_ASSISTED in hf_kinds else None)
    return HFBaselines(target_cfg, draft_cfg, packed_linears=args.hf_packed_linears)


def _warm_up_and_run(runner, plan, warmup: bool) -> None:
    if warmup:
        _log("specd bench: warming up...")
        runner.warm_up()
    _log(f"specd bench: {len(plan.configs)} configs x {len(plan.temperatures)} temperatures x "
         f"{len(plan.concurrency)} concurrency levels x {len(plan.conditions)} network conditions, "
         f"{len(plan.prompts)} prompts, {plan.repeats} repeat(s)")
    runner.run()
