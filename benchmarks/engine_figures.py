"""Issue-2 figures for the model engine on real models.

    python benchmarks/engine_figures.py [--models qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct]

Per model: load time from the cache; prefill of a 200-token prompt; one
forward step of 1 and 5 new tokens (bf16 and fp32, 1 and 2 threads); rollback
at context 64 vs 4096; KV bytes per token; a batched forward of 1, 4 and 16
sessions of mixed lengths vs the same sessions one by one. Prints Markdown.
Medians of repeated runs; the machine is shared, so read ratios, not digits.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.engine.config import EngineConfig
from specdec.engine.engine import ExtendItem, ModelEngine
from specdec.models.catalog import DEFAULT_PAIR


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_times(engine: ModelEngine, repeat: int) -> dict[str, float]:
    s = engine.open_session(list(range(100, 300)))
    out = {}
    engine.extend([ExtendItem(s.id, None, [], 1)])
    for n in (1, 5):
        def step():
            engine.extend([ExtendItem(s.id, 200, [11] * n, n)])
        step()
        out[f"step_{n}"] = median_time(step, repeat)
    engine.close(s.id)
    return out


def prefill_time(engine: ModelEngine, repeat: int) -> float:
    prompt = list(range(100, 300))

    def run():
        s = engine.open_session(prompt)
        engine.extend([ExtendItem(s.id, None, [], 1)])
        engine.close(s.id)
    return median_time(run, repeat)


def rollback_time(engine: ModelEngine, context: int, repeat: int = 2000) -> float:
    s = engine.open_session([5] * 8, max_new_tokens=context)
    engine.append_tokens(s.id, [5] * (context - 8))
    engine.extend([ExtendItem(s.id, None, [], 1)])

    def run():
        engine.rollback(s.id, context - 4)
        engine.append_tokens(s.id, [5] * 4)
        s.cached = context  # restore the pointer: the KV stays valid
    t = median_time(run, repeat)
    engine.close(s.id)
    return t


def batch_times(engine: ModelEngine, n: int, repeat: int) -> tuple[float, float]:
    lengths = [50 + (37 * i) % 250 for i in range(n)]
    sessions = [engine.open_session(list(range(3, 3 + L))) for L in lengths]
    for s in sessions:
        engine.extend([ExtendItem(s.id, None, [], 1)])
    items = [ExtendItem(s.id, L, [7] * 5, 5) for s, L in zip(sessions, lengths)]
    batched = median_time(lambda: engine.extend(items), repeat)
    alone = median_time(lambda: [engine.extend([it]) for it in items], repeat)
    for s in sessions:
        engine.close(s.id)
    return batched, alone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_PAIR))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for model in args.models:
        for dtype in ("bfloat16", "float32"):
            torch.set_num_threads(2)
            start = time.perf_counter()
            engine = ModelEngine.load(EngineConfig(model=model, dtype=dtype, threads=2, max_context=4200))
            load_s = time.perf_counter() - start
            engine.warmup()
            row = {"model": model, "dtype": dtype, "load_s": load_s, "kv_bytes_per_token": engine.kv_shape.bytes_per_token,
                   "prefill_200_s": prefill_time(engine, args.repeat)}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for key, value in step_times(engine, args.repeat).items():
                    row[f"{key}_t{threads}"] = value
            torch.set_num_threads(2)
            if dtype == "bfloat16":
                row["rollback_64_us"] = rollback_time(engine, 64) * 1e6
                row["rollback_4096_us"] = rollback_time(engine, 4096) * 1e6
                for n in (1, 4, 16):
                    row[f"batch_{n}"] = batch_times(engine, n, max(2, args.repeat // 2))
            rows.append(row)
            del engine
    print("| model | dtype | load s | prefill 200 tok s | step 1 tok ms (1t/2t) | step 5 tok ms (1t/2t) | KV B/token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['load_s']:.1f} | {r['prefill_200_s']:.2f} | "
              f"{r['step_1_t1']*1e3:.0f} / {r['step_1_t2']*1e3:.0f} | {r['step_5_t1']*1e3:.0f} / {r['step_5_t2']*1e3:.0f} | "
              f"{r['kv_bytes_per_token']} |")
    print()
    print("| model | rollback @64 us | rollback @4096 us | ratio | batch 1: batched / one-by-one ms | batch 4 | batch 16 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "rollback_64_us" not in r:
            continue
        cells = [f"{r[f'batch_{n}'][0]*1e3:.0f} / {r[f'batch_{n}'][1]*1e3:.0f}" for n in (1, 4, 16)]
        print(f"| {r['model']} | {r['rollback_64_us']:.1f} | {r['rollback_4096_us']:.1f} | "
              f"{r['rollback_4096_us']/r['rollback_64_us']:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
