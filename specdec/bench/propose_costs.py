"""What a Propose of k drafts costs the draft per drafted token, its steps
one at a time (`ModelDrafter.step_many`, a host sync per step) against run
ahead (`ModelDrafter.chain_steps`: each step fed the step before's picks on
the device and queued before the host reads them).

    specd steps MODEL --propose [--device cuda] [--num-draft-tokens 4 8] [--batches 1 8]

Measured on the drafter itself, no service around it: B sessions of `context`
tokens are cut back to their context and handed one token, as a round's
Propose is, and drafted k greedy tokens each (min_confidence 0: all k). The
two ways alternate run by run on the same engine, so a busy machine's load
falls on both alike; medians of `repeat` runs after one warm-up run each.
Both make the same drafts (tests/test_draft_run_ahead.py); on a CPU each step
runs as it is called, so the two should cost the same there, and a GPU shows
what the sync per step cost.
"""
from __future__ import annotations

import statistics
import time

from specdec.bench.step_costs import StepCost, sync, weight_bytes

MODES = (("off", "propose, steps one at a time"), ("on", "propose, run ahead"))


def measure(engine, *, ks=(4,), batches=(1, 8), context: int = 200, repeat: int = 10,
            bandwidth: float) -> list[StepCost]:
    """Per drafted token, both ways, for each batch size and k (see module doc)."""
    from draft_service.drafters import ModelDrafter
    from specdec.rpc.model_service import SessionMeta
    from specdec.sampling.params import SamplingParams

    drafters = {mode: ModelDrafter(engine, max_draft_tokens=max(ks), run_ahead=mode) for mode, _ in MODES}
    greedy = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
    floor_ms = weight_bytes(engine.model) / bandwidth * 1000
    dtype = str(engine.dtype).removeprefix("torch.")
    out = []
    for b in batches:
        opener = drafters["off"]
        sids = [opener.open([3 + (i + j) % 100 for j in range(context)], greedy, max(ks) + 2)[0] for i in range(b)]
        try:
            for k in ks:
                times: dict[str, list[float]] = {mode: [] for mode, _ in MODES}
                for _ in range(repeat + 1):
                    for mode, _ in MODES:
                        times[mode].append(_timed_propose(drafters[mode], sids, context, k))
                for mode, label in MODES:
                    per_token_ms = statistics.median(times[mode][1:]) / k * 1000
                    out.append(StepCost(engine.name, str(engine.device), dtype, label, f"propose {b}x{k}", b, k,
                                        per_token_ms, floor_ms))
        finally:
            for sid in sids:
                opener.close(sid)
    return out


def _timed_propose(drafter, sids: list[str], context: int, k: int) -> float:
    """Seconds to draft k tokens on each session, one Propose each, stepped
    together as the draft service steps concurrent Proposes."""
    sync(drafter.engine.device)
    start = time.perf_counter()
    streams = [drafter.propose(sid, context, [7], k) for sid in sids]
    while not all(s.done for s in streams):
        if drafter.run_ahead:
            drafter.chain_steps(streams, lambda: True)
        else:
            drafter.step_many(streams)
    sync(drafter.engine.device)
    return time.perf_counter() - start
