"""`specd bench`: target-only, HF transformers and specdec side by side.

    specd bench --quick                       # a few minutes on a CPU, default real pair
    specd bench                               # the full sweep (hours on a CPU)
    specd bench --pair tiny --quick           # tiny random pair, token-id prompts
    specd bench --rtt-ms 0 2 10 50            # ... through latency proxies

One invocation starts the target, draft and orchestrator as child processes
(logs in the results folder), loads the target (and the draft) in this
process for the HF baselines, runs every config interleaved, stops the
services, and writes runs.jsonl, requests.jsonl, summary.md and PNG plots.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from specdec.bench.runner import BASELINES, HF, HF_ASSISTED, SERVICE
from specdec.errors import InvalidArgument
from specdec.limits import check_num_draft_tokens
from specdec.models.catalog import DEFAULT_PAIR

QUICK = dict(prompts=1, chat_prompts=1, token_prompts=2, max_tokens=16, num_draft_tokens=[4],
             policies=["fixed", "adaptive", "goodput", "goodput-pipeline"], temperatures=[0.0, 0.7],
             concurrency=[1, 4], repeats=1)
FULL = dict(prompts=10, chat_prompts=4, token_prompts=10, max_tokens=128, num_draft_tokens=[2, 3, 4, 5, 6],
            policies=["fixed", "adaptive", "goodput", "goodput-pipeline"], temperatures=[0.0, 0.7],
            concurrency=[1, 4, 8], repeats=3)


class UsageError(Exception):
    """A mistake of the user's: one line, exit code 2."""


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark target-only, HF transformers and specdec side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models and devices")
    g.add_argument("--pair", choices=("default", "tiny"), default="default",
                   help="default: --draft/--target (the real pair unless given); tiny: a small random pair "
                        "with token-id prompts (specdec.bench.tiny_pair)")
    g.add_argument("--draft", default=None, help=f"draft: catalog name or model directory (default {DEFAULT_PAIR.draft})")
    g.add_argument("--target", default=None, help=f"target: catalog name or model directory (default {DEFAULT_PAIR.target})")
    g.add_argument("--device", default="cpu", help="device of both roles and the HF baselines: cpu, cuda, cuda:N")
    g.add_argument("--draft-device", default=None, help="the draft's device (default --device)")
    g.add_argument("--target-device", default=None, help="the target's device (default --device)")
    g.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    g.add_argument("--threads", type=int, default=0, help="CPU threads per model service and for the HF "
                                                          "baselines (0: torch's default)")
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
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="results folder (default bench-results/<UTC timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the models to load")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="deadline of each request, seconds")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ options


def _pick(args, name: str):
    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else FULL)[name]


def resolve(args: argparse.Namespace) -> dict:
    """Every setting, defaults filled in and checked; raises UsageError."""
    o = {name: _pick(args, name) for name in FULL}
    o["baselines"] = list(BASELINES) if args.baselines is None else list(args.baselines)
    o["policies"] = [] if o["policies"] == ["none"] else list(o["policies"])
    o["token_prompt_len"] = args.token_prompt_len
    for name in ("max_tokens", "repeats", "token_prompt_len"):
        if o[name] < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    try:
        for k in o["num_draft_tokens"]:
            check_num_draft_tokens(k)  # the services' default limit
    except InvalidArgument as exc:
        raise UsageError(f"--num-draft-tokens: {exc}") from None
    if any(c < 1 for c in o["concurrency"]):
        raise UsageError("--concurrency values must be at least 1")
    if any(t < 0 for t in o["temperatures"]):
        raise UsageError("--temperatures must be >= 0")
    if args.threads < 0:
        raise UsageError("--threads must be >= 0")
    if args.rtt_ms and (args.draft_rtt_ms is not None or args.target_rtt_ms is not None):
        raise UsageError("use either --rtt-ms (a sweep, both services) or --draft-rtt-ms/--target-rtt-ms")
    if any(x < 0 for x in (args.rtt_ms or []) + [v for v in (args.draft_rtt_ms, args.target_rtt_ms) if v is not None]) \
            or args.jitter_ms < 0:
        raise UsageError("round-trip times and jitter must be >= 0")
    for name in ("device", "draft_device", "target_device"):
        dev = getattr(args, name)
        if dev is not None and not (dev == "cpu" or dev == "cuda" or dev.startswith("cuda:")):
            raise UsageError(f"--{name.replace('_', '-')} must be cpu, cuda or cuda:N, not {dev!r}")
    o["draft_device"] = args.draft_device or args.device
    o["target_device"] = args.target_device or args.device
    if any(d.startswith("cuda") for d in (o["draft_device"], o["target_device"])):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("a cuda device was asked for, but torch sees no CUDA device here")

    # models and prompts
    if args.pair == "tiny":
        if args.draft or args.target:
            raise UsageError("--pair tiny picks its own models: drop --draft/--target")
        if args.prompts or args.chat_prompts:
            raise UsageError("--pair tiny has no tokenizer: use --token-prompts N, not --prompts/--chat-prompts")
        o["token_mode"] = True
    else:
        o["draft"] = args.draft or DEFAULT_PAIR.draft
        o["target"] = args.target or DEFAULT_PAIR.target
        o["draft_dir"] = _resolve_model(o["draft"])
        o["target_dir"] = _resolve_model(o["target"])
        o["token_mode"] = args.token_prompts is not None
        if o["token_mode"] and (args.prompts or args.chat_prompts):
            raise UsageError("--token-prompts replaces the text prompts: drop --prompts/--chat-prompts")
    if o["token_mode"]:
        o["prompts"], o["chat_prompts"] = 0, 0
        if o["token_prompts"] < 1:
            raise UsageError("--token-prompts must be at least 1")
    else:
        o["token_prompts"] = 0
        if o["prompts"] < 0 or o["chat_prompts"] < 0 or o["prompts"] + o["chat_prompts"] < 1:
            raise UsageError("give at least one prompt (--prompts N and/or --chat-prompts N)")
        from specdec.bench.prompts import CHAT_PROMPTS

        if o["chat_prompts"] > len(CHAT_PROMPTS):
            raise UsageError(f"--chat-prompts: there are {len(CHAT_PROMPTS)} chat prompts")

    from specdec.bench.runner import build_configs, network_conditions

    try:
        o["configs"] = build_configs(o["baselines"], o["num_draft_tokens"], o["policies"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not o["configs"]:
        raise UsageError("nothing to run: give --baselines and/or --policies")
    if (HF in o["baselines"] or HF_ASSISTED in o["baselines"]) and 1 not in o["concurrency"]:
        raise UsageError("the HF baselines run at concurrency 1: include 1 in --concurrency or drop them")
    o["concurrency_configs"] = args.concurrency_configs
    if args.concurrency_configs:
        unknown = set(args.concurrency_configs) - {c.name for c in o["configs"] if c.kind == SERVICE}
        if unknown:
            raise UsageError(f"--concurrency-configs: no service config named {', '.join(sorted(unknown))}")
    elif args.quick:  # target-only and one specdec config: the newest policy asked for, else the first
        spec = [c.name for c in o["configs"] if c.speculative]
        o["concurrency_configs"] = ["target-only"] + ([spec[-1]] if spec else [])
    o["conditions"] = network_conditions(args.rtt_ms, args.draft_rtt_ms, args.target_rtt_ms, args.jitter_ms)
    o["uses_services"] = any(c.kind == SERVICE for c in o["configs"])
    if any(c.proxied for c in o["conditions"]):
        if not o["uses_services"]:
            raise UsageError("network conditions apply to the services: add service configs")
        try:
            import specdec.latency_proxy  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"network conditions need specdec.latency_proxy, which cannot be imported: {exc}") from None
    return o


def _resolve_model(name: str) -> str:
    """A model directory; a catalog model not fetched yet is fetched first, as
    `specd up` does, so `specd bench` works on a fresh machine."""
    from specdec.models.cache import ModelNotFoundError, resolve_model
    from specdec.models.catalog import CATALOG

    try:
        return str(resolve_model(name))
    except ModelNotFoundError as exc:
        if name not in CATALOG:
            raise UsageError(f"{exc} (`specd models list` shows the catalog)") from None
    from specdec.models.fetch import fetch

    fetch(name)
    return str(resolve_model(name))


def _tiny_pair(o: dict) -> None:
    try:
        from specdec.bench.tiny_pair import ensure_tiny_pair
    except ImportError as exc:
        raise UsageError(f"--pair tiny needs specdec.bench.tiny_pair, which cannot be imported: {exc}") from None
    draft_dir, target_dir = ensure_tiny_pair()
    o["draft"] = o["draft_dir"] = str(draft_dir)
    o["target"] = o["target_dir"] = str(target_dir)


def build_prompts(o: dict, pair: str, seed: int) -> list:
    """Prompt token ids, the same for every system."""
    from specdec.bench.runner import Prompt

    if o["token_mode"]:
        if pair == "tiny":
            from specdec.bench.tiny_pair import tiny_prompts

            ids = tiny_prompts(o["token_prompts"])
        else:
            ids = _random_token_prompts(o["target_dir"], o["token_prompts"], o["token_prompt_len"], seed)
        return [Prompt(i, "token-ids", tuple(int(t) for t in p), seed + i, f"{len(p)} random tokens")
                for i, p in enumerate(ids)]
    tok = _tokenizer(o["target_dir"])
    prompts = []
    if o["prompts"]:
        from specdec.bench.prompts import humaneval_prompts

        for text in humaneval_prompts(o["prompts"]):
            ids = list(tok(text, add_special_tokens=True)["input_ids"])  # as the orchestrator tokenizes text
            prompts.append(("humaneval", ids, text.strip().splitlines()[0][:60]))
    if o["chat_prompts"]:
        from specdec.bench.prompts import chat_prompts

        if not getattr(tok, "chat_template", None):
            raise UsageError("the target's tokenizer has no chat template: use --chat-prompts 0")
        for messages in chat_prompts(o["chat_prompts"]):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            prompts.append(("chat", list(ids), messages[0]["content"][:60]))
    return [Prompt(i, kind, tuple(int(t) for t in ids), seed + i, label) for i, (kind, ids, label) in enumerate(prompts)]


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise UsageError(f"the target {model_dir} has no tokenizer ({exc.__class__.__name__}): "
                         "use --token-prompts N") from None


def _random_token_prompts(model_dir: str, n: int, length: int, seed: int) -> list[list[int]]:
    import random

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    special = {t for t in [*eos, config.bos_token_id, getattr(config, "pad_token_id", None)] if t is not None}
    rng = random.Random(seed)
    vocab = int(config.vocab_size)
    out = []
    for _ in range(n):
        prompt = []
        while len(prompt) < length:
            t = rng.randrange(3, vocab)
            if t not in special:
                prompt.append(t)
        out.append(prompt)
    return out


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
        if args.pair == "tiny":
            _tiny_pair(o)
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
    import torch

    from specdec.bench import report
    from specdec.bench.aggregate import build_runs
    from specdec.bench.machine import describe_machine
    from specdec.bench.runner import Plan, Runner, mark_identity
    from specdec.bench.services import ServiceOptions, ServiceSet
    from specdec.engine.loading import resolve_dtype

    machine = describe_machine()
    command = _command_line(args)
    plan = Plan(configs=o["configs"], prompts=prompts, temperatures=o["temperatures"], concurrency=o["concurrency"],
                repeats=o["repeats"], conditions=o["conditions"], max_tokens=o["max_tokens"],
                concurrency_configs=o["concurrency_configs"])

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    requests_file = open(out_dir / "requests.jsonl", "w")

    def on_record(record: dict) -> None:
        requests_file.write(json.dumps(record) + "\n")
        requests_file.flush()

    services = None
    if o["uses_services"]:
        services = ServiceSet(ServiceOptions(draft=o["draft_dir"], target=o["target_dir"], draft_device=o["draft_device"],
                                             target_device=o["target_device"], dtype=args.dtype, threads=args.threads,
                                             tokenizer=o["target_dir"], startup_timeout_s=args.startup_timeout),
                              out_dir / "logs")
    runner = None
    interrupted, rc = False, 0
    threads_before = torch.get_num_threads()
    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(*_):
            raise KeyboardInterrupt

        # SIGINT too: a shell starting `specd bench &` leaves SIGINT ignored
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous_handlers[sig] = signal.signal(sig, on_signal)
    try:
        if services is not None:
            log(f"specd bench: starting the services (logs in {out_dir / 'logs'})...")
            services.start_models()
        hf = None
        hf_kinds = {c.kind for c in o["configs"]} & {HF, HF_ASSISTED}
        if hf_kinds:
            from specdec.bench.hf_baselines import HFBaselines
            from specdec.engine.config import EngineConfig

            log("specd bench: loading the HF baselines in this process...")
            target_cfg = EngineConfig(model=o["target_dir"], device=o["target_device"], dtype=args.dtype,
                                      threads=args.threads)
            draft_cfg = (EngineConfig(model=o["draft_dir"], device=o["draft_device"], dtype=args.dtype,
                                      threads=args.threads) if HF_ASSISTED in hf_kinds else None)
            hf = HFBaselines(target_cfg, draft_cfg)
        if services is not None:
            services.wait_models()
            first = o["conditions"][0]
            if any(c.proxied for c in o["conditions"]):
                services.start_proxies(first.one_way_delays_ms(), first.jitter_ms)
            services.start_orchestrator()
            (out_dir / "services.json").write_text(json.dumps(services.describe(), indent=2) + "\n")
        runner = Runner(plan, services=services, hf=hf, request_timeout_s=args.request_timeout,
                        progress=not args.no_progress, on_record=on_record, log=log)
        if args.warmup:
            log("specd bench: warming up...")
            runner.warm_up()
        log(f"specd bench: {len(plan.configs)} configs x {len(plan.temperatures)} temperatures x "
            f"{len(plan.concurrency)} concurrency levels x {len(plan.conditions)} network conditions, "
            f"{len(prompts)} prompts, {plan.repeats} repeat(s)")
        runner.run()
    except KeyboardInterrupt:
        interrupted, rc = True, 130
        log("specd bench: interrupted; stopping the services and writing what finished...")
    except RuntimeError as exc:
        rc = 1
        log(f"specd bench: {exc}")
    finally:
        if services is not None:
            services.stop()
        requests_file.close()
        torch.set_num_threads(threads_before)
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)

    records = runner.records if runner is not None else []
    if not records:
        log(f"specd bench: no results; logs in {out_dir}")
        return rc or 1
    mark_identity(records)
    report.write_jsonl(out_dir / "requests.jsonl", records)
    dtypes = {role: str(resolve_dtype(args.dtype, o[f"{role}_device"])).removeprefix("torch.")
              for role in ("draft", "target")}
    settings = {
        "prompts": f"{len(prompts)} ({_prompt_kinds(prompts)}), sent to the orchestrator as token ids",
        "max tokens": o["max_tokens"], "configs": ", ".join(c.name for c in o["configs"]),
        "temperatures": ", ".join(f"{t:g}" for t in o["temperatures"]),
        "concurrency": ", ".join(map(str, o["concurrency"])), "repeats": o["repeats"],
        "network": ", ".join(c.name for c in o["conditions"]) + (f", jitter {args.jitter_ms:g} ms"
                                                                  if args.jitter_ms else ""),
        "seeds": f"{args.seed} + prompt index",
    }
    models = {"draft": f"{o['draft']} on {o['draft_device']}, {dtypes['draft']}",
              "target": f"{o['target']} on {o['target_device']}, {dtypes['target']}",
              "threads per service": args.threads or "torch default"}
    extra = {"machine": machine, "command": command, "models": {"draft": o["draft"], "target": o["target"],
             "draft_device": o["draft_device"], "target_device": o["target_device"], "dtype": dtypes,
             "threads": args.threads}, "started_utc": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat()}
    runs = build_runs(records, extra)
    report.write_jsonl(out_dir / "runs.jsonl", runs)
    plots = report.write_plots(runs, out_dir)
    notes = ["The HF baselines run in this process at concurrency 1, under the first network condition only.",
             "At concurrency c > 1 each wave sends the prompts (cycled up to a multiple of c) through c client "
             "threads pulling from one queue."]
    if any(r.get("time_split") and not r["time_split"]["draft_compute_reported"] for r in runs):
        notes.append("This orchestrator does not report draft_compute_time_s: the draft share (*) is the propose "
                     "RPC time, network included, and the ideal bound is not computed.")
    if any(r.get("kind") == SERVICE and r.get("policy") != "none" and r.get("round_trips_per_token") is None
           for r in runs):
        notes.append("This orchestrator does not report round_trips: round trips/token shows -.")
    wall = time.time() - started
    meta = {"machine": machine, "command": command, "settings": settings, "models": models,
            "skipped": runner.skipped if runner else {}, "interrupted": interrupted, "wall_s": wall,
            "notes": notes, "plots": plots}
    summary = report.summary_markdown(runs, meta=meta)
    (out_dir / "summary.md").write_text(summary + "\n")
    print(summary)
    print(f"\nspecd bench: results in {out_dir} ({wall:.0f} s)")
    return rc


def _prompt_kinds(prompts: list) -> str:
    kinds: dict[str, int] = {}
    for p in prompts:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in kinds.items())
