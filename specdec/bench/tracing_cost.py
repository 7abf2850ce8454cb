"""What tracing costs end to end (`specd overhead --end-to-end`; formerly
benchmarks/tracing_overhead.py): tokens/s with tracing on vs off, spans per
generated token, and the cost of one span.

Two complete systems (target, draft, orchestrator, in-process on
127.0.0.1:0) over the SAME engines: one traced as `specd up` traces
(BatchSpanProcessor into a JSON-lines file), one with tracing off
(SPECD_TRACING=off: the no-op tracer). Greedy requests alternate between the
two, the order flipping every request, each starting once the previous one's
sessions are closed (the engines are shared, and are not thread-safe).
Reported: the median tokens/s of each (client-side wall time), the overhead,
and spans per generated token counted from the trace file.

Default pair: the tiny pair of `specdec.bench.tiny_pair` (float32, no EOS, so
every request runs to its max_tokens; token-id prompts); `random_pair()` is
the former script's default (the tests' 2-layer random pair). With a target
and a draft named: models from the cache, HumanEval prompts through the
tokenizer.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from specdec import telemetry as T

DEADLINE_S = 120.0
ROLES = {"draft": T.SERVICE_DRAFT, "target": T.SERVICE_TARGET, "orchestrator": T.SERVICE_ORCHESTRATOR}


@contextmanager
def running_system(target_engine, draft_engine, tokenizer, telemetry: dict):
    """Target, draft and orchestrator services over these engines, each on its
    own event loop thread, on 127.0.0.1:0; yields the orchestrator's Client."""
    from draft_service.drafters import ModelDrafter
    from draft_service.server import start_draft_service
    from orchestrator.client import Client
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import start_orchestrator
    from specdec.eventloop import BackgroundLoop
    from specdec.rpc.session_limits import SessionLimits
    from specdec.rpc.serving import ServerConfig
    from target_service.server import start_target_service
    from target_service.verifier import Verifier

    limits = SessionLimits()
    local = ServerConfig(host="127.0.0.1", port=0)
    with ExitStack() as stack:
        def serve(name: str, start):
            loop = BackgroundLoop(timeout_s=DEADLINE_S, name=f"tracing-cost-{name}")
            stack.callback(loop.close)
            server = loop.run(start)
            stack.callback(lambda: loop.run(server.stop(0)))
            return server

        target = serve("target", start_target_service(
            local, limits, lambda: Verifier(target_engine, limits.max_draft_tokens, limits.max_verify_batch),
            telemetry=telemetry["target"]))
        draft = serve("draft", start_draft_service(
            local, limits, lambda: ModelDrafter(draft_engine, limits.max_draft_tokens),
            telemetry=telemetry["draft"]))
        cfg = OrchestratorConfig(target=f"127.0.0.1:{target.port}", draft=f"127.0.0.1:{draft.port}",
                                 connect_timeout_s=30)
        orch = serve("orchestrator", start_orchestrator(local, cfg, tokenizer=tokenizer,
                                                        telemetry=telemetry["orchestrator"]))
        client = stack.enter_context(Client(f"127.0.0.1:{orch.port}", timeout_s=DEADLINE_S))
        yield client


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


@dataclass
class TracingCost:
    pair: str
    requests: int
    tokens: int
    num_draft_tokens: int
    rates: dict[str, list[float]] = field(default_factory=lambda: {"on": [], "off": []})  # tok/s per request
    generated: dict[str, int] = field(default_factory=lambda: {"on": 0, "off": 0})  # warm-up included
    spans: int = 0  # in the traced system's file
    traced_requests: int = 0  # its generate spans
    span_us_on: float = 0.0
    span_us_off: float = 0.0

    def median(self, mode: str) -> float:
        return statistics.median(self.rates[mode])

    @property
    def overhead(self) -> float:
        """Fraction of tokens/s lost with tracing on (medians; negative: gained)."""
        return 1 - self.median("on") / self.median("off")

    @property
    def spans_per_token(self) -> float:
        return self.spans / max(1, self.generated["on"])


def measure(target_engine, draft_engine, tokenizer, prompts, *, pair: str, requests: int, tokens: int,
            num_draft_tokens: int, trace_dir: Path | None = None, span_reps: int = 1000) -> TracingCost:
    from specdec.trace_file import read_spans

    trace_dir = Path(trace_dir or tempfile.mkdtemp(prefix="specd-tracing-"))
    trace_file = trace_dir / "traces.jsonl"
    traced = {role: T.setup_telemetry(service, T.TelemetrySettings(trace_file=str(trace_file)))
              for role, service in ROLES.items()}
    untraced = {role: T.setup_telemetry(service, T.TelemetrySettings.from_env({"SPECD_TRACING": "off"}))
                for role, service in ROLES.items()}
    out = TracingCost(pair, requests, tokens, num_draft_tokens)
    engines = (target_engine, draft_engine)
    try:
        with running_system(target_engine, draft_engine, tokenizer, traced) as on, \
                running_system(target_engine, draft_engine, tokenizer, untraced) as off:
            clients = {"on": on, "off": off}
            for mode in ("on", "off"):  # warm both paths once, unmeasured
                warm = clients[mode].complete(prompts[0], max_tokens=8, temperature=0,
                                               num_draft_tokens=num_draft_tokens)
                out.generated[mode] += warm.stats.completion_tokens
                wait_idle(engines)
            for i in range(requests):
                for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                    start = time.perf_counter()
                    result = clients[mode].complete(prompts[i % len(prompts)], max_tokens=tokens, temperature=0,
                                                    num_draft_tokens=num_draft_tokens)
                    out.rates[mode].append(result.stats.completion_tokens / (time.perf_counter() - start))
                    out.generated[mode] += result.stats.completion_tokens
                    wait_idle(engines)
    finally:
        for t in traced.values():
            t.shutdown()
    spans = read_spans(trace_file) if trace_file.exists() else []
    out.spans = len(spans)
    out.traced_requests = sum(s["name"] == T.SPAN_GENERATE for s in spans)
    bench = T.setup_telemetry("bench", T.TelemetrySettings(trace_file=str(trace_dir / "bench.jsonl")))
    try:
        out.span_us_on = span_cost_us(bench, span_reps)
        out.span_us_off = span_cost_us(untraced["orchestrator"], span_reps)
    finally:
        bench.shutdown()
    return out


def report(c: TracingCost) -> str:
    lines = [f"pair: {c.pair}, greedy, k={c.num_draft_tokens}, {c.requests} requests x {c.tokens} tokens per mode, "
             "interleaved",
             "| tracing | median tokens/s | min | max |", "|---|---:|---:|---:|"]
    for mode, label in (("off", "off (SPECD_TRACING=off)"), ("on", "on (JSONL file, batch processor)")):
        r = c.rates[mode]
        lines.append(f"| {label} | {statistics.median(r):.1f} | {min(r):.1f} | {max(r):.1f} |")
    lines += ["", f"overhead: tracing on gives {100 * c.overhead:.1f}% fewer tokens/s (medians; negative: more)",
              f"spans: {c.spans} for {c.traced_requests} requests (warm-up included), "
              f"{c.spans_per_token:.2f} per generated token, {c.spans / max(1, c.traced_requests):.0f} per request",
              f"one span (start + end, 3 attributes, best of 5): {c.span_us_on:.1f} µs traced, "
              f"{c.span_us_off * 1000:.0f} ns with tracing off"]
    return "\n".join(lines)


def random_pair():
    """The former script's default pair (the tests' tiny random pair): a
    2-layer random target (`overhead.tiny_model`, seed 0, vocab 128) and a
    draft that is the target plus noise (0.15 of each tensor's std, seed 1),
    their EOS disabled so every request runs to its max_tokens."""
    import copy

    import torch

    from specdec.bench.overhead_stack import tiny_engine, tiny_model

    target = tiny_model(seed=0)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std())
    for model in (target, draft):
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
    prompts = [[3 + (7 * i + j * j) % 120 for j in range(8 + i % 9)] for i in range(64)]
    return (tiny_engine(model=target, name="tiny-random-target"), tiny_engine(model=draft, name="tiny-random-draft"),
            None, prompts)


def load_pair(target: str = "", draft: str = "", dtype: str = "auto", threads: int = 0, device: str = "cpu"):
    """(target engine, draft engine, tokenizer, prompts): the tiny pair (float32)
    when no target is named; else the named models, warmed, with HumanEval
    prompts through the target's tokenizer (token-id prompts of the tiny
    pair's kind if it has none)."""
    from orchestrator.tokenizer import load_tokenizer
    from specdec.bench.tiny_pair import ensure_tiny_pair, tiny_prompts
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine

    if not target:
        draft_dir, target_dir = ensure_tiny_pair()
        target, draft, dtype = str(target_dir), str(draft_dir), "float32"
    engines = []
    for name in (target, draft):
        engine = ModelEngine.load(EngineConfig(model=name, dtype=dtype, threads=threads, device=device))
        engine.warmup()
        engines.append(engine)
    if engines[0].tokenizer is None:
        return engines[0], engines[1], None, tiny_prompts(64)
    from specdec.bench.prompts import humaneval_prompts

    return engines[0], engines[1], load_tokenizer(target), humaneval_prompts(64)
