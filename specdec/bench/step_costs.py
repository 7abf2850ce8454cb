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
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    """Bytes of the weights a forward reads: parameters, tied ones once, and
    the weights of replaced linears (int8: engine/quantize.py; packed bf16:
    engine/packed_linear.py). A step reads one row of the input embedding:
    when the output head no longer shares its matrix, it is not counted."""
    seen, total = set(), 0
    embedding = getattr(model.get_input_embeddings(), "weight", None)
    head = getattr(model.get_output_embeddings(), "weight", None)
    if embedding is not None and (head is None or head.data_ptr() != embedding.data_ptr()):
        seen.add(embedding.data_ptr())
    for p in model.parameters():
        if p.data_ptr() not in seen:  # tied embeddings count once
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total + sum(m.weight_nbytes for m in model.modules() if hasattr(m, "weight_nbytes"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(engine, *, ks=(4,), batches=(1, 8), context: int = 200, repeat: int = 10,
            bandwidth: float | None = None) -> list[StepCost]:
    """Step costs of `engine` at decode and verify shapes (see module doc)."""
    return measure_interleaved([engine], ks=ks, batches=batches, context=context, repeat=repeat, bandwidth=bandwidth)


def measure_interleaved(engines, *, ks=(4,), batches=(1, 8), context: int = 200, repeat: int = 10,
                        bandwidth: float | None = None) -> list[StepCost]:
    """Step costs of several engines (e.g. one model bf16 and int8), each
    timed run of one engine followed by the same step of the others, so a busy
    machine's load falls on all alike; medians of `repeat` runs after one
    warm-up run each."""
    from specdec.engine.engine import ExtendItem

    bandwidth = bandwidth or copy_bandwidth(engines[0].device)
    shapes = [("decode", 1)] + [("verify", k + 1) for k in ks]
    out: list[StepCost] = []
    saved = [e.steps for e in engines]
    try:
        for b in batches:
            sessions = []
            for engine in engines:
                opened = [engine.open_session([3 + (i + j) % 100 for j in range(context)]) for i in range(b)]
                for s in opened:
                    engine.extend([ExtendItem(s.id, None, [], 1)])
                sessions.append(opened)
            for path in ("static", "eager"):
                runs = [(e, opened) for e, opened, steps in zip(engines, sessions, saved) if path == "eager" or steps]
                for kind, n in shapes:
                    times: list[list[float]] = [[] for _ in runs]
                    for _ in range(repeat + 1):
                        for (engine, opened), engine_times in zip(runs, times):
                            engine.steps = None if path == "eager" else saved[engines.index(engine)]
                            items = [ExtendItem(s.id, context, [7] * n, n) for s in opened]
                            engine_times.append(_timed_once(engine, items))
                    for (engine, _), engine_times in zip(runs, times):
                        label = path if path == "eager" else ("graphs" if engine.device.type == "cuda" else "static")
                        floor_ms = weight_bytes(engine.model) / bandwidth * 1000
                        out.append(StepCost(engine.name, str(engine.device), str(engine.dtype).removeprefix("torch."),
                                            label, f"{kind} {b}x{n}", b, n,
                                            statistics.median(engine_times[1:]) * 1000, floor_ms))
            for engine, opened in zip(engines, sessions):
                for s in opened:
                    engine.close(s.id)
    finally:
        for engine, steps in zip(engines, saved):
            engine.steps = steps
    return out


def _timed_once(engine, items) -> float:
    sync(engine.device)
    start = time.perf_counter()
    engine.extend(items)
    sync(engine.device)
    return time.perf_counter() - start


def markdown(costs: list[StepCost]) -> str:
    lines = ["| model | path | step | ms | floor ms | × floor |", "|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c.model} | {c.path} | {c.shape} | {c.ms:.2f} | {c.floor_ms:.2f} | {c.over_floor:.1f} |")
    if any(c.shape.startswith("propose") for c in costs):
        lines.append("\nA propose row's ms is per drafted token (bench/propose_costs.py).")
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
