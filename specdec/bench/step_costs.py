"""Step costs of one model engine against the memory-bandwidth floor.

    specd bench --steps MODEL [MODEL ...] [--device cuda] [--dtype bfloat16]

On a GPU a decode step should cost close to reading the weights once:
floor = weight bytes / copy bandwidth (measured here, on the same device).
This measures, per model, the engine's step at the shapes a speculative
round uses, each as a multiple of that floor:

- decode: 1 token for B sessions (B = 1, 8: the draft's steps);
- verify: k + 1 tokens for B sessions (the target's verify);

with the engine's fixed-shape steps (CUDA graphs on CUDA) and, where they
differ, the eager path beside them. Sessions hold `context` tokens, so the
attention reads a realistic prefix. Medians of `repeat` runs, synchronized
with the device.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class StepCost:
    model: str
    device: str
    dtype: str
    path: str  # "graphs" | "static" | "eager"
    shape: str  # e.g. "decode 1x1", "verify 8x5"
    sessions: int
    tokens_per_session: int
    ms: float
    floor_ms: float

    @property
    def over_floor(self) -> float:
        return self.ms / self.floor_ms

    def to_json(self) -> dict:
        return dict(asdict(self), over_floor=self.over_floor)


def copy_bandwidth(device: torch.device, megabytes: int = 512, repeat: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    n = megabytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:  # tied embeddings count once
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(engine, items, repeat: int) -> float:
    from specdec.engine.engine import ExtendItem

    times = []
    for _ in range(repeat + 1):
        _sync(engine.device)
        start = time.perf_counter()
        engine.extend([ExtendItem(i.session_id, i.keep_length, i.tokens, i.num_logits) for i in items])
        _sync(engine.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000  # the first run warms up


def measure(engine, *, ks=(4,), batches=(1, 8), context: int = 200, repeat: int = 10,
            bandwidth: float | None = None) -> list[StepCost]:
    """Step costs of `engine` at decode and verify shapes (see module doc)."""
    from specdec.engine.engine import ExtendItem

    bandwidth = bandwidth or copy_bandwidth(engine.device)
    floor_ms = weight_bytes(engine.model) / bandwidth * 1000
    paths = [("graphs" if engine.device.type == "cuda" else "static", engine.steps)] if engine.steps else []
    paths.append(("eager", None))
    shapes = [("decode", 1)] + [("verify", k + 1) for k in ks]
    out: list[StepCost] = []
    saved = engine.steps
    try:
        for b in batches:
            sessions = [engine.open_session([3 + (i + j) % 100 for j in range(context)]) for i in range(b)]
            for s in sessions:
                engine.extend([ExtendItem(s.id, None, [], 1)])
            for path, steps in paths:
                engine.steps = steps
                for kind, n in shapes:
                    items = [ExtendItem(s.id, context, [7] * n, n) for s in sessions]
                    out.append(StepCost(engine.name, str(engine.device), str(engine.dtype).removeprefix("torch."),
                                        path, f"{kind} {b}x{n}", b, n, _timed(engine, items, repeat), floor_ms))
            for s in sessions:
                engine.close(s.id)
    finally:
        engine.steps = saved
    return out


def markdown(costs: list[StepCost]) -> str:
    lines = ["| model | path | step | ms | floor ms | × floor |", "|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c.model} | {c.path} | {c.shape} | {c.ms:.2f} | {c.floor_ms:.2f} | {c.over_floor:.1f} |")
    return "\n".join(lines)


def plot(costs: list[StepCost], path) -> None:
    """Step cost as a multiple of the floor: one group of bars per step shape,
    one bar per model (and per path when several were measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(c.shape for c in costs))
    several_paths = len({c.path for c in costs}) > 1
    series = list(dict.fromkeys(f"{c.model} ({c.path})" if several_paths else c.model for c in costs))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(shapes) + 0.25 * len(series) * len(shapes)), 3.8), dpi=80)
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        values = {c.shape: c.over_floor for c in costs
                  if (f"{c.model} ({c.path})" if several_paths else c.model) == name}
        ax.bar([x + i * width for x in range(len(shapes))], [values.get(s, 0) for s in shapes], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="bandwidth floor")
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(shapes))], shapes, fontsize=8)
    ax.set_ylabel("step cost / floor")
    ax.set_title(f"Step cost against the memory-bandwidth floor ({costs[0].device}, {costs[0].dtype})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
