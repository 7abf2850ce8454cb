"""Fixed-shape forward steps, captured as CUDA graphs on CUDA devices.

A decode or verify step is small (one token per session, or k + 1) and on a
GPU its cost is mostly Python and kernel launches, not arithmetic. So the
engine keeps, per model, static input buffers and one step per token-count
bucket (1..16, then coarser up to `max_tokens`), and on CUDA captures each as
a CUDA graph at start-up (SGLang's and vLLM's CUDA-graph runners work this
way). A step of n tokens is padded to the smallest bucket >= n: its tokens,
positions and slot bases are copied into the buffers, the padding tokens
point at the store's scratch position (they write there and read only it),
and the graph is replayed. Larger steps (prefill chunks) run eagerly.

The attention inside a captured step must take its layout from tensors only:
the fused Triton kernel (`triton_attention.py`). Without capture (a CPU, or
`--cuda-graphs off`) the same padded steps run eagerly with either kernel;
the tests use that to check the bucketing and padding rules on the CPU.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from specdec.engine.attention import STEP_KWARG, row_mask
from specdec.engine.kv_store import KVStore, RowSpan, StepLayout, StoreCache
from specdec.engine.model_facts import cache_kwarg
from specdec.host_copy import host_staged

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Every count up to 16, then steps of 8 to 64, then of 32."""
    assert max_tokens >= 1, max_tokens
    sizes = list(range(1, 17)) + list(range(24, 65, 8)) + list(range(96, max(max_tokens, 96) + 32, 32))
    out = sorted({min(s, max_tokens) for s in sizes})
    return out


@dataclass(frozen=True)
class CaptureReport:
    buckets: int
    seconds: float
    graph_bytes: int


class StaticSteps:
    """Padded fixed-shape steps over one model and its store (see module doc)."""

    def __init__(self, model, store: KVStore, max_tokens: int, kernel: str, keeps_logits: bool):
        self.model = model
        self.store = store
        self.kernel = kernel
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        device = store.shape.device
        self.device = device
        # The step's inputs live here for the life of the engine: a captured
        # graph reads these addresses.
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.position = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.key_base = torch.full((self.max_tokens,), store.scratch_index, dtype=torch.long, device=device)
        self.write_index = torch.full((self.max_tokens,), store.scratch_index, dtype=torch.long, device=device)
        self._keeps_logits = keeps_logits
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    # ---------------------------------------------------------------- running

    def fits(self, num_tokens: int) -> bool:
        return 1 <= num_tokens <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int], bases: list[int]) -> torch.Tensor:
        """Logits [n, V] of the n given tokens (each at its position in the
        slot whose flat base is given), padded to a bucket. The tokens may be
        a tensor on the device the host has not read (a chained draft step)."""
        n = len(tokens)
        size = self.bucket(n)
        if isinstance(tokens, torch.Tensor):
            self._fill([0] * n, positions, bases, size)
            self.input_ids[:n].copy_(tokens)
        else:
            self._fill(tokens, positions, bases, size)
        graph = self._graphs.get(size)
        if graph is not None:
            graph[0].replay()
            return graph[1][:n].clone()
        return self._forward(size, host_rows=_rows(positions, bases, size, self.store))[:n]

    def _fill(self, tokens: list[int], positions: list[int], bases: list[int], size: int) -> None:
        n = len(tokens)
        pad = size - n
        scratch = self.store.scratch_index
        # One host tensor, one copy to the device.
        staged = host_staged([tokens + [0] * pad, positions + [0] * pad, bases + [scratch] * pad], self.device)
        self.input_ids[:size].copy_(staged[0], non_blocking=True)
        self.position[:size].copy_(staged[1], non_blocking=True)
        self.key_base[:size].copy_(staged[2], non_blocking=True)
        torch.add(self.key_base[:size], self.position[:size], out=self.write_index[:size])

    def _forward(self, size: int, host_rows: list[RowSpan] | None = None) -> torch.Tensor:
        layout = StepLayout(
            rows=host_rows or [],
            write_index=self.write_index[:size],
            key_base=self.key_base[:size],
            position=self.position[:size],
            kernel=self.kernel,
        )
        kwargs = {"logits_to_keep": 0} if self._keeps_logits else {}
        with torch.inference_mode():
            out = self.model(
                input_ids=self.input_ids[:size].unsqueeze(0),
                position_ids=self.position[:size].unsqueeze(0),
                use_cache=True,
                **{cache_kwarg(self.model): StoreCache(self.store, layout), STEP_KWARG: layout},
                **kwargs,
            )
        return out.logits[0]

    # -------------------------------------------------------------- capture

    def capture(self) -> CaptureReport:
        """Capture one CUDA graph per bucket, largest first, sharing one
        memory pool. Needs the fused kernel: a graph cannot run the
        per-session reference kernel's Python loop."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        assert self.kernel == "triton", "a captured step needs the fused attention kernel"
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.buckets):
            self._fill([0] * size, [0] * size, [self.store.scratch_index] * size, size)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile the kernels, settle the allocator
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        report = CaptureReport(len(self.buckets), time.perf_counter() - started,
                               max(0, free_before - torch.cuda.mem_get_info(self.device)[0]))
        log.info("captured %d CUDA graphs (steps of 1..%d tokens) in %.2f s; they hold %.1f MiB",
                 report.buckets, self.max_tokens, report.seconds, report.graph_bytes / 2**20)
        return report

    @property
    def captured(self) -> bool:
        return bool(self._graphs)


def _rows(positions: list[int], bases: list[int], size: int, store: KVStore) -> list[RowSpan]:
    """Host-side rows for the reference kernel: each run of consecutive
    positions of one slot is a row; each padding token a row of its own that
    sees the scratch position only."""
    rows: list[RowSpan] = []
    t = 0
    n = len(positions)
    while t < n:
        stop = t + 1
        while stop < n and bases[stop] == bases[t] and positions[stop] == positions[stop - 1] + 1:
            stop += 1
        rows.append(RowSpan(t, stop, bases[t], positions[t], row_mask(stop - t, positions[t], store.shape.device)))
        t = stop
    rows.extend(RowSpan(i, i + 1, store.scratch_index, 0) for i in range(n, size))
    return rows
