"""A model engine's costs around the steps (`specd steps MODEL --lifecycle`).

Beside `step_costs.py`'s decode and verify steps, per model (formerly
benchmarks/engine_figures.py):

- load: seconds for `ModelEngine.load` from the cache (timed by the caller);
- prefill: open a session on a `context`-token prompt and compute its first
  logits, closed again; median of `repeat` runs;
- rollback at context 64 vs 4096 (or the contexts given): cut the last 4
  tokens and append them again, with the KV left valid; median of 2000 runs
  in microseconds. It moves a length pointer, so it should not grow with the
  context;
- KV bytes per token (the engine's KV geometry);
- a batched forward of B sessions of mixed lengths (50-300 tokens), n new
  tokens each, vs the same items one by one; median of max(2, repeat // 2)
  runs each, the two interleaved.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

ROLLBACK_CONTEXTS = (64, 4096)
ROLLBACK_REPEAT = 2000
ROLLBACK_CUT = 4


@dataclass(frozen=True)
class BatchCost:
    sessions: int
    tokens_per_session: int
    batched_ms: float
    one_by_one_ms: float

    @property
    def gain(self) -> float:
        """Throughput of the batched forward over one by one."""
        return self.one_by_one_ms / self.batched_ms


@dataclass
class Lifecycle:
    model: str
    device: str
    dtype: str
    load_s: float
    prefill_tokens: int
    prefill_s: float
    kv_bytes_per_token: int
    rollback_us: dict[int, float] = field(default_factory=dict)  # context -> µs
    batches: list[BatchCost] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        out["rollback_us"] = {str(k): v for k, v in self.rollback_us.items()}
        out["batches"] = [dict(asdict(b), gain=b.gain) for b in self.batches]
        return out


def _median_s(fn, repeat: int, sync=lambda: None) -> float:
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync_of(engine):
    from specdec.bench.step_costs import sync

    return lambda: sync(engine.device)


def prefill_s(engine, tokens: int, repeat: int) -> float:
    from specdec.engine.engine import ExtendItem

    prompt = [3 + (i * 7) % 200 for i in range(tokens)]

    def run():
        s = engine.open_session(prompt)
        engine.extend([ExtendItem(s.id, None, [], 1)])
        engine.close(s.id)
    run()  # the first run warms up
    return _median_s(run, repeat, _sync_of(engine))


def rollback_us(engine, context: int, repeat: int = ROLLBACK_REPEAT) -> float:
    from specdec.engine.engine import ExtendItem

    s = engine.open_session([5] * 8, max_new_tokens=context - 8)
    engine.append_tokens(s.id, [5] * (context - 8))
    engine.extend([ExtendItem(s.id, None, [], 1)])

    def run():
        engine.rollback(s.id, context - ROLLBACK_CUT)
        engine.append_tokens(s.id, [5] * ROLLBACK_CUT)
        s.cached = context  # restore the pointer: the KV stays valid
    try:
        return _median_s(run, repeat) * 1e6
    finally:
        engine.close(s.id)


def batch_cost(engine, sessions: int, tokens: int, repeat: int) -> BatchCost:
    from specdec.engine.engine import ExtendItem

    lengths = [50 + (37 * i) % 250 for i in range(sessions)]
    opened = [engine.open_session([3 + j % 100 for j in range(n)]) for n in lengths]
    try:
        for s in opened:
            engine.extend([ExtendItem(s.id, None, [], 1)])
        items = [ExtendItem(s.id, n, [7] * tokens, tokens) for s, n in zip(opened, lengths)]
        sync = _sync_of(engine)
        engine.extend(items)  # warm the batched shape
        batched, alone = [], []
        for _ in range(repeat):  # interleaved, so a machine whose load drifts moves both alike
            batched.append(_median_s(lambda: engine.extend(items), 1, sync))
            alone.append(_median_s(lambda: [engine.extend([it]) for it in items], 1, sync))
    finally:
        for s in opened:
            engine.close(s.id)
    return BatchCost(sessions, tokens, statistics.median(batched) * 1000, statistics.median(alone) * 1000)


def measure(engine, *, load_s: float, context: int = 200, batches=(1, 4, 16), tokens: int = 5,
            rollback_contexts=ROLLBACK_CONTEXTS, repeat: int = 5) -> Lifecycle:
    """The figures above for a loaded (and warmed) engine."""
    out = Lifecycle(engine.name, str(engine.device), str(engine.dtype).removeprefix("torch."), load_s,
                    context, prefill_s(engine, context, repeat), engine.kv_shape.bytes_per_token)
    for c in rollback_contexts:
        out.rollback_us[c] = rollback_us(engine, c)
    for b in batches:
        out.batches.append(batch_cost(engine, b, tokens, max(2, repeat // 2)))
    return out


def markdown(rows: list[Lifecycle]) -> str:
    if not rows:
        return ""
    contexts = list(rows[0].rollback_us)
    batch_sizes = [b.sessions for b in rows[0].batches]
    n = rows[0].batches[0].tokens_per_session if rows[0].batches else 0
    head = (["model", "dtype", "load s", f"prefill {rows[0].prefill_tokens} tok s", "KV B/token"]
            + [f"rollback @{c} µs" for c in contexts]
            + ([f"ratio @{contexts[-1]}/@{contexts[0]}"] if len(contexts) > 1 else [])
            + [f"{b} sessions x {n} tok: batched / one by one ms" for b in batch_sizes])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.model, r.dtype, f"{r.load_s:.1f}", f"{r.prefill_s:.2f}" if r.prefill_s >= 0.1 else f"{r.prefill_s:.3f}", str(r.kv_bytes_per_token)]
        cells += [f"{r.rollback_us[c]:.1f}" for c in contexts]
        if len(contexts) > 1:
            cells.append(f"{r.rollback_us[contexts[-1]] / r.rollback_us[contexts[0]]:.2f}")
        cells += [f"{_ms(b.batched_ms)} / {_ms(b.one_by_one_ms)}" for b in r.batches]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2f}"
