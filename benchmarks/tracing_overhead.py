"""What tracing costs (issue 5): tokens/s with tracing on vs off, spans per
generated token, and the cost of one span.

    python benchmarks/tracing_overhead.py [--requests 30] [--tokens 64] [--num-draft-tokens 4]
    python benchmarks/tracing_overhead.py --draft qwen2.5-coder-0.5b-instruct \\
        --target qwen2.5-coder-1.5b-instruct --requests 10 --tokens 64 --threads 2

Two complete systems (target, draft, orchestrator, in-process on 127.0.0.1:0)
over the SAME engines: one traced as `specd up` traces (BatchSpanProcessor
into a JSON-lines file), one with tracing off (SPECD_TRACING=off: the no-op
tracer, no client interceptors). Greedy requests alternate between the two,
the order flipping every request, each starting once the previous one's
sessions are closed (the engines are shared, and are not thread-safe).
Printed: the median tokens/s of each (client-side wall time), the overhead,
and spans per generated token counted from the trace file.

Default: the tiny random pair of the tests (the draft is the target plus
noise, its EOS disabled so every request runs to --tokens). With --draft and
--target: models from the cache, HumanEval prompts through the tokenizer.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import telemetry as T  # noqa: E402
from specdec.trace_file import read_spans  # noqa: E402
from tests.harness import running_system  # noqa: E402

ROLES = {"draft": T.SERVICE_DRAFT, "target": T.SERVICE_TARGET, "orchestrator": T.SERVICE_ORCHESTRATOR}


def tiny_pair():
    from tests.conftest import tiny_engine, tiny_model
    from tests.test_orchestrator import perturbed, without_eos

    target = without_eos(tiny_model(seed=0, init_range=0.3))
    draft = without_eos(perturbed(target, 0.15, seed=1))
    prompts = [[3 + (7 * i + j * j) % 120 for j in range(8 + i % 9)] for i in range(64)]
    return tiny_engine(model=target), tiny_engine(model=draft), None, prompts


def real_pair(args):
    from orchestrator.server import load_tokenizer
    from specdec.bench.prompts import humaneval_prompts
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine

    engines = []
    for name in (args.target, args.draft):
        engine = ModelEngine.load(EngineConfig(model=name, dtype=args.dtype, threads=args.threads,
                                               device=args.device))
        engine.warmup()
        engines.append(engine)
    return engines[0], engines[1], load_tokenizer(args.target), humaneval_prompts(64)


def wait_idle(engines, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(e.num_sessions for e in engines) and time.monotonic() < deadline:
        time.sleep(0.005)


def span_cost_us(telemetry: T.Telemetry, n: int = 1000, repeats: int = 5) -> float:
    """Microseconds to start and end one span with three attributes, on the
    calling thread: the best of `repeats` runs, since other load only adds
    (n stays under the batch queue's 2048, so no span is dropped; the export
    itself runs on the processor's thread)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(n):
            with telemetry.span("bench", {T.A_K: 4, T.A_ROUND: i}) as span:
                span.set_attribute(T.A_ACCEPTED, 2)
        best = min(best, (time.perf_counter() - start) / n * 1e6)
        telemetry.force_flush()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30, help="requests per mode")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="tokens drafted per round (fixed policy)")
    parser.add_argument("--draft", default="", help="draft model (default: the tiny random pair)")
    parser.add_argument("--target", default="", help="target model (with --draft)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()

    target_engine, draft_engine, tokenizer, prompts = real_pair(args) if args.target else tiny_pair()
    trace_file = Path(tempfile.mkdtemp()) / "traces.jsonl"
    traced = {role: T.setup_telemetry(service, T.TelemetrySettings(trace_file=str(trace_file)))
              for role, service in ROLES.items()}
    untraced = {role: T.setup_telemetry(service, T.TelemetrySettings.from_env({"SPECD_TRACING": "off"}))
                for role, service in ROLES.items()}
    rates: dict[str, list[float]] = {"on": [], "off": []}
    tokens = {"on": 0, "off": 0}
    engines = (target_engine, draft_engine)
    with running_system(target_engine, draft_engine, tokenizer=tokenizer, telemetry=traced) as on, \
            running_system(target_engine, draft_engine, tokenizer=tokenizer, telemetry=untraced) as off:
        systems = {"on": on, "off": off}
        for mode in ("on", "off"):  # warm both paths once, unmeasured
            warm = systems[mode].client.complete(prompts[0], max_tokens=8, temperature=0, num_draft_tokens=args.num_draft_tokens)
            tokens[mode] += warm.stats.completion_tokens
            wait_idle(engines)
        for i in range(args.requests):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                start = time.perf_counter()
                result = systems[mode].client.complete(prompts[i % len(prompts)], max_tokens=args.tokens,
                                                       temperature=0, num_draft_tokens=args.num_draft_tokens)
                rates[mode].append(result.stats.completion_tokens / (time.perf_counter() - start))
                tokens[mode] += result.stats.completion_tokens
                wait_idle(engines)
    for t in traced.values():
        t.shutdown()

    spans = read_spans(trace_file)
    requests = sum(s["name"] == T.SPAN_GENERATE for s in spans)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(f"pair: {'tiny random' if not args.target else f'{args.draft} -> {args.target}'}, greedy, "
          f"k={args.num_draft_tokens}, {args.requests} requests x {args.tokens} tokens per mode, interleaved")
    print("| tracing | median tokens/s | min | max |")
    print("|---|---:|---:|---:|")
    for mode, label in (("off", "off (SPECD_TRACING=off)"), ("on", "on (JSONL file, batch processor)")):
        print(f"| {label} | {statistics.median(rates[mode]):.1f} | {min(rates[mode]):.1f} | "
              f"{max(rates[mode]):.1f} |")
    print(f"\noverhead: tracing on gives {100 * (1 - on / off):.1f}% fewer tokens/s (medians; negative: more)")
    print(f"spans: {len(spans)} for {requests} requests (warm-up included), "
          f"{len(spans) / max(1, tokens['on']):.2f} per generated token, "
          f"{len(spans) / max(1, requests):.0f} per request")
    bench = T.setup_telemetry("bench", T.TelemetrySettings(trace_file=str(trace_file.with_name("bench.jsonl"))))
    print(f"one span (start + end, 3 attributes, best of 5): {span_cost_us(bench):.1f} µs traced, "
          f"{span_cost_us(untraced['orchestrator']) * 1000:.0f} ns with tracing off")
    bench.shutdown()


if __name__ == "__main__":
    main()
