"""`specd steps MODEL [MODEL ...]`: each model's decode and verify step costs
against the memory-bandwidth floor (specdec/bench/step_costs.py), on the
device and dtype the services would use, with a Markdown table, JSON lines and
a plot in --out. With --lifecycle, also load time, prefill, rollback at two
context lengths, KV bytes per token, and a batched forward of --batches
sessions vs the same sessions one by one (specdec/bench/lifecycle.py).

    specd steps synth:qwen2.5-0.5b synth:qwen2.5-7b --device cuda --dtype bfloat16 --num-draft-tokens 4
    specd steps qwen2.5-coder-0.5b-instruct --draft-vocab 0 8192 16384 32768
    specd steps qwen2.5-coder-0.5b-instruct --dtype bfloat16 --threads 2 --batches 1 4 16 --lifecycle
    specd steps qwen2.5-coder-0.5b-instruct --dtype bfloat16 --threads 2 --batches 1 --quantize none int8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.cli.exits import EXIT_ERROR, EXIT_OK
from specdec.cli.flag_types import at_least
from specdec.cli.model_flags import add_device, add_dtype, add_threads
from specdec.engine.config import AUTO_ON_OFF, QUANTIZE_CHOICES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("steps", help="step costs of models against the memory-bandwidth floor",
                       description="Measure each model's decode (1 token per session) and verify (k+1 tokens per "
                       "session) steps, with the fixed-shape path (CUDA graphs on CUDA) and the eager path, as "
                       "multiples of weight bytes / measured copy bandwidth.")
    p.add_argument("models", nargs="+", metavar="MODEL", help="catalog names, directories, or synth:NAME")
    add_device(p)
    add_dtype(p)
    add_threads(p)
    p.add_argument("--num-draft-tokens", type=at_least(0), nargs="+", default=[4],
                   help="verify shapes: num_draft_tokens + 1 tokens per session (default 4)")
    p.add_argument("--batches", type=at_least(1), nargs="+", default=[1, 8], help="sessions per step (default 1 8)")
    p.add_argument("--context", type=at_least(1), default=200, help="tokens each session holds (default 200)")
    p.add_argument("--repeat", type=at_least(1), default=10, help="timed runs per shape; the median is reported")
    p.add_argument("--draft-vocab", type=int, nargs="+", default=[0],
                   help="output head sizes to measure (0: full; needs `specd models rank-vocab`, "
                        "except a synth: model, whose head keeps the lowest ids: costs only)")
    p.add_argument("--quantize", nargs="+", default=["none"], choices=[c for c in QUANTIZE_CHOICES if c != "auto"],
                   help="weights to measure: none (the dtype's) and/or int8 (CPU; engine/quantize.py), "
                   "interleaved per step shape when several are given")
    p.add_argument("--packed-linears", nargs="+", default=["auto"], choices=AUTO_ON_OFF,
                   help="bf16 linears pre-packed for oneDNN (CPU; engine/packed_linear.py): auto, on and/or off, "
                   "interleaved like --quantize (default auto)")
    p.add_argument("--fused-layers", nargs="+", default=["auto"], choices=AUTO_ON_OFF,
                   help="Llama-family layers as fused kernels (engine/fused_decoder.py; auto: where the model allows): auto, on "
                   "and/or off, interleaved like --quantize (default auto)")
    p.add_argument("--propose", action="store_true",
                   help="also time a Propose of each --num-draft-tokens k greedy drafts per session, per drafted "
                   "token, its steps one at a time vs run ahead on the device, and run ahead at T = 0.7 "
                   "(what the sampled picks add; bench/propose_costs.py)")
    life = p.add_argument_group("--lifecycle: the engine's costs around the steps")
    life.add_argument("--lifecycle", action="store_true",
                      help="also measure load time, prefill of a --context-token prompt, rollback at "
                      "--rollback-contexts, KV bytes per token, and a forward of --batches sessions (mixed lengths "
                      "50-300, num_draft_tokens + 1 new tokens each) batched vs one by one")
    life.add_argument("--rollback-contexts", type=int, nargs="+", default=[64, 4096], metavar="N",
                      help="context lengths to time rollback at (default 64 4096)")
    p.add_argument("--out", default="bench-results/steps", help="results folder (default bench-results/steps)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import gc
    import time

    import torch

    from specdec.bench import lifecycle, propose_costs
    from specdec.bench.step_costs import copy_bandwidth, markdown, measure_interleaved, plot
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine
    from specdec.errors import SpecdecError

    if args.lifecycle and min(args.rollback_contexts) < 16:
        print("specd: error: --rollback-contexts must be at least 16", file=sys.stderr)
        return EXIT_ERROR
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    costs, lives = [], []
    bandwidth = None
    max_context = args.context + max(args.num_draft_tokens) + 8
    if args.lifecycle:  # the batched sessions hold up to 300 tokens
        max_context = max(max_context, *args.rollback_contexts, 300 + max(args.num_draft_tokens) + 8)
    for model in args.models:
        for head in args.draft_vocab:
            engines, load_times = [], []
            variants = [(q, pk, fl) for q in args.quantize for pk in args.packed_linears for fl in args.fused_layers]
            for quantize, packed, fused in variants:
                try:
                    cfg = EngineConfig(model=model, device=args.device, dtype=args.dtype, threads=args.threads,
                                       max_context=max_context, max_sessions=max(args.batches), draft_vocab=head,
                                       quantize=quantize, packed_linears=packed, fused_layers=fused)
                    start = time.perf_counter()
                    engine = ModelEngine.load(cfg)
                    load_times.append(time.perf_counter() - start)
                except (SpecdecError, ValueError, OSError) as error:
                    print(f"specd: error: {model}: {error}", file=sys.stderr)
                    return EXIT_ERROR
                engine.warmup()
                engine.name = engine.name + (f" (head {head})" if head else "") + \
                    (f" ({quantize})" if quantize != "none" else "") + \
                    (f" (packed {packed})" if len(args.packed_linears) > 1 else "") + \
                    (f" (fused {'on' if engine.fused else 'off'})" if len(args.fused_layers) > 1 else "")
                engines.append(engine)
            bandwidth = bandwidth or copy_bandwidth(engines[0].device)
            costs += measure_interleaved(engines, ks=args.num_draft_tokens, batches=args.batches, context=args.context,
                                         repeat=args.repeat, bandwidth=bandwidth)
            if args.propose:
                for engine in engines:
                    costs += propose_costs.measure(engine, ks=args.num_draft_tokens, batches=args.batches,
                                                   context=args.context, repeat=args.repeat, bandwidth=bandwidth)
            if args.lifecycle:
                for engine, load_s in zip(engines, load_times):
                    try:
                        lives.append(lifecycle.measure(engine, load_s=load_s, context=args.context,
                                                       batches=args.batches, tokens=args.num_draft_tokens[0] + 1,
                                                       rollback_contexts=args.rollback_contexts, repeat=args.repeat))
                    except SpecdecError as error:  # e.g. a rollback context beyond what the model holds
                        print(f"specd: error: {model}: {error}", file=sys.stderr)
                        return EXIT_ERROR
            del engines, engine
            gc.collect()  # the next model's automatic KV budget reads the device's free memory
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    table = markdown(costs)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s\n{table}")
    (out / "steps.md").write_text(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s\n\n{table}\n")
    with open(out / "steps.jsonl", "w") as f:
        for c in costs:
            f.write(json.dumps(dict(c.to_json(), bandwidth=bandwidth)) + "\n")
    plot(costs, out / "steps.png")
    if lives:
        table = lifecycle.markdown(lives)
        print(f"\n{table}")
        (out / "lifecycle.md").write_text(table + "\n")
        with open(out / "lifecycle.jsonl", "w") as f:
            for life in lives:
                f.write(json.dumps(life.to_json()) + "\n")
    return EXIT_OK
