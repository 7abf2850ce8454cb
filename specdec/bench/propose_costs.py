"""What a Propose of k drafts costs the draft per drafted token, its steps
one at a time (`ModelDrafter.step_many`, a host sync per step) against run
ahead (`ModelDrafter.chain_steps`: each step fed the step before's picks on
the device and queued before the host reads them).

    specd steps MODEL --propose [--device cuda] [--num-draft-tokens 4 8] [--batches 1 8]

Measured on the drafter itself, no service around it: B sessions of `context`
tokens are cut back to their context and handed one token, as a round's
Propose is, and drafted k greedy tokens each (min_confidence 0: all k); and
run ahead again with sessions sampling at T = 0.7, whose picks after each
step (the q's truncation and draw, sampling/draft_picks.py) are what a
sampled step adds: with the picks replayed as CUDA graphs where the engine's
steps are (sampling/pick_graphs.py), with them launched one operation at a
time, and with every other session greedy (two groups of picks a step). The
ways alternate run by run on the same engine, so a busy machine's load falls
on all alike (the sessions of each kind are opened afresh when their turn
comes, then drafted once untimed); medians of `repeat` runs after one
warm-up run each.
The two greedy ways make the same drafts (tests/test_draft_run_ahead.py); on a
CPU each step runs as it is called, so they should cost the same there, and a
GPU shows what the sync per step cost. The sampled rows draft other tokens, of
course: what they add to run ahead's row is the sampled picks' cost (on a
CPU there are no graphs, so the eager row is the graphs' row again).
"""
from __future__ import annotations

import statistics
import time

from specdec.bench.step_costs import StepCost, sync, weight_bytes

# The sessions' temperatures: all greedy, all T = 0.7, or every other one T = 0.7 (the first
# included) and the rest greedy.
GREEDY, SAMPLED, MIXED = "greedy", "T = 0.7", "mixed"
# (the drafter's run_ahead, whether its picks replay as CUDA graphs, the sessions, the row's label)
MODES = (("off", True, GREEDY, "propose, steps one at a time"), ("on", True, GREEDY, "propose, run ahead"),
         ("on", True, SAMPLED, "propose, run ahead, T = 0.7"),
         ("on", False, SAMPLED, "propose, run ahead, T = 0.7, eager picks"),
         ("on", True, MIXED, "propose, run ahead, every other session T = 0.7"))


def measure(engine, *, ks=(4,), batches=(1, 8), context: int = 200, repeat: int = 10,
            bandwidth: float) -> list[StepCost]:
    """Per drafted token, each way, for each batch size and k (see module doc)."""
    from draft_service.drafters import ModelDrafter

    drafters = {(run_ahead, graphs): ModelDrafter(engine, max_draft_tokens=max(ks), run_ahead=run_ahead,
                                                  pick_graphs=graphs)
                for run_ahead, graphs, _, _ in MODES}
    floor_ms = weight_bytes(engine.model) / bandwidth * 1000
    dtype = str(engine.dtype).removeprefix("torch.")
    out = []
    for b in batches:
        sessions = _Sessions(drafters["off", True], b, context, max(ks) + 2)
        try:
            for k in ks:
                times: dict[str, list[float]] = {label: [] for *_, label in MODES}
                for _ in range(repeat + 1):
                    for run_ahead, graphs, kind, label in MODES:
                        sids, opened = sessions.of(kind)
                        if opened:  # not timed: the caches are the prefill's, not a round's
                            _timed_propose(drafters[run_ahead, graphs], sids, context, k)
                        times[label].append(_timed_propose(drafters[run_ahead, graphs], sids, context, k))
                for *_, label in MODES:
                    per_token_ms = statistics.median(times[label][1:]) / k * 1000
                    out.append(StepCost(engine.name, str(engine.device), dtype, label, f"propose {b}x{k}", b, k,
                                        per_token_ms, floor_ms))
        finally:
            sessions.close()
    return out


class _Sessions:
    """B sessions of one kind (GREEDY, SAMPLED, MIXED), one kind open at a
    time: an engine sized for B sessions (`specd steps` sizes it for its
    largest batch; a GPU's KV store has that many slots) has no room for two
    sets at once. Switching closes one set and opens the other, outside the
    timed Proposes."""

    def __init__(self, opener, batch: int, context: int, max_new_tokens: int):
        self.opener, self.batch, self.context, self.max_new_tokens = opener, batch, context, max_new_tokens
        self.kind: str | None = None
        self.sids: list[str] = []

    def of(self, kind: str) -> tuple[list[str], bool]:
        """The sessions of `kind`, and whether they were opened just now."""
        from specdec.rpc.model_service import SessionMeta
        from specdec.sampling.params import SamplingParams

        if kind == self.kind:
            return self.sids, False
        self.close()
        for i in range(self.batch):
            sampled = kind == SAMPLED or (kind == MIXED and i % 2 == 0)
            meta = SessionMeta(params=SamplingParams(0.7 if sampled else 0.0, 0, 1.0), seed=1 + i)
            prompt = [3 + (i + j) % 100 for j in range(self.context)]
            self.sids.append(self.opener.open(prompt, meta, self.max_new_tokens)[0])
        self.kind = kind
        return self.sids, True

    def close(self) -> None:
        while self.sids:
            self.opener.close(self.sids.pop())
        self.kind = None


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
