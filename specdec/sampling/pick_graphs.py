"""The draft's picks of a step as one CUDA graph replay.

After each draft step, `draft_picks.pick_on_device` turns the step's logits
into its tokens and, for sampled rows, their proposals q: 9 tensor
operations greedy, 40-60 sampled (softmax, the top entries, the draw, the
packing), each a kernel launch from Python. The H200 profile of a sampled
Propose showed the host, not the GPU, setting the pace: 2.2 ms a step
against 1.1 ms greedy, the device idle between launches.

A step whose rows all sample alike (the usual case) has fixed shapes and no
host sync (`draft_picks.one_group`), so it is captured here once per shape
(rows, vocabulary, logits dtype, sampling, q width) and replayed after: a
copy of the logits into the graph's input, one of the uniforms, the replay
and two copies out, 5 launches. The graph runs the very kernels the eager
operations launch, on the same inputs, so its picks are the same bits
(tests/test_device_picks.py compares them on a GPU).

The first step of a new shape pays for its capture: torch synchronizes the
device and empties its allocators' caches before capturing, and the
operations run twice beforehand on a side stream. Row counts 1-8 at one
temperature are 8 captures over a service's life. A capture that fails (a
kernel that cannot be captured in some torch version) is logged once and
that shape stays eager. `SPECD_PICK_GRAPHS=off`
turns the graphs off; they are only made where the engine replays its steps
as CUDA graphs.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdec.host_copy import host_staged
from specdec.sampling.draft_picks import one_group
from specdec.sampling.params import SamplingParams

log = logging.getLogger(__name__)

ENV = "SPECD_PICK_GRAPHS"
# Shapes kept at once: row counts change as streams come and go, and each
# temperature (top-k, top-p) of the requests drafting is a shape of its own.
CAPACITY = 64


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # the graph's inputs, written before each replay
    us: torch.Tensor
    tokens: torch.Tensor  # its outputs, overwritten by each replay
    packed: torch.Tensor
    width: int


class PickGraphs:
    """Captured picks by shape, for one CUDA device (see the module doc)."""

    def __init__(self, device: torch.device, capacity: int = CAPACITY):
        assert device.type == "cuda", device
        self.device = device
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._failed: set[tuple] = set()
        self._pool = None
        self.captures = 0  # graphs captured so far (for tests and logs)
        self.replays = 0

    @classmethod
    def for_engine(cls, engine) -> "PickGraphs | None":
        """Graphs for `engine`'s picks where it replays its steps as CUDA
        graphs (and `SPECD_PICK_GRAPHS` is not off); else None."""
        if os.environ.get(ENV, "on").strip().lower() in ("off", "0", "false", "no"):
            return None
        steps = getattr(engine, "steps", None)
        if engine.device.type != "cuda" or steps is None or not steps.captured:
            return None
        return cls(engine.device)

    def run(self, logits: torch.Tensor, params: SamplingParams | None, max_q_tokens: int,
            us: list[float] | None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """`one_group`'s (tokens, packed, width) by a replay, or None where
        this shape has no graph and cannot have one (then the caller runs
        the operations eagerly)."""
        key = (tuple(logits.shape), logits.dtype, params, max_q_tokens)
        captured = self._graphs.get(key)
        if captured is None:
            if key in self._failed:
                return None
            captured = self._capture(key, logits, params, max_q_tokens)
            if captured is None:
                return None
        else:
            self._graphs.move_to_end(key)
        captured.logits.copy_(logits)
        if us is not None:
            captured.us.copy_(host_staged(us, self.device, torch.float64), non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        # Copies out: the next replay overwrites the graph's outputs while
        # these may still be read (the step after feeds on the tokens).
        return captured.tokens.clone(), captured.packed.clone(), captured.width

    def _capture(self, key: tuple, logits: torch.Tensor, params: SamplingParams | None,
                 max_q_tokens: int) -> _Captured | None:
        static_logits = logits.clone()
        static_us = torch.full((logits.shape[0],), 0.5, dtype=torch.float64, device=self.device)
        us = None if params is None else static_us

        def picks():
            return one_group(static_logits, params, max_q_tokens, us)

        try:
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(2):  # the kernels' first runs (and any lazily made constants) outside the graph
                    picks()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # One memory pool for all the shapes: a later capture may reuse the
            # blocks of an earlier one's temporaries, even for its outputs. That
            # is safe because replays are queued on one stream one at a time and
            # each replay's outputs are copied out (`run`) before the next replay
            # is queued, so no replay overwrites outputs not yet copied.
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                tokens, packed, width = picks()
        except Exception as exc:  # noqa: BLE001 - this shape then runs eagerly, as before
            self._failed.add(key)
            log.warning("the draft's picks for %d rows (%s) could not be captured as a CUDA graph; they run "
                        "eagerly: %s: %s", logits.shape[0], "greedy" if params is None else params,
                        type(exc).__name__, exc)
            return None
        if len(self._graphs) >= self.capacity:
            self._graphs.popitem(last=False)
        captured = _Captured(graph, static_logits, static_us, tokens, packed, width)
        self._graphs[key] = captured
        self.captures += 1
        log.debug("captured the draft's picks for %d rows (%s)", logits.shape[0],
                  "greedy" if params is None else params)
        return captured
