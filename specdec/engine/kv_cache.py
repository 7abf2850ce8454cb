"""The KV cache: one pre-allocated buffer per session, rolled back in O(1).

Each session owns one tensor for keys and one for values, shaped
`[layers, kv_heads, capacity, head_dim]`, and a length pointer. Writing a token
puts its keys/values at index `length`; rollback moves the pointer and copies
nothing, so its cost does not depend on the context length.

A forward pass over several sessions sees them through a `BatchKVView`, a
transformers `Cache` built for that one call: its `update()` writes each row's
new keys/values into that row's session buffer and returns keys/values for the
whole batch (a view of the buffer when the batch has one session; a gathered,
zero-padded copy otherwise). Rows are left-aligned at position 0, so the
attention mask, not the cache layout, says which positions each row may see.

Limitation: the mask built by the engine is plain causal attention; models
whose layers use sliding-window or chunked attention are limited to contexts
within their window (the engine enforces it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True)
class KVShape:
    """Per-token geometry of a model's KV cache, probed from a real forward."""

    num_layers: int
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.kv_heads * (self.head_dim + self.value_dim) * elem


class SessionKV:
    """Keys and values of one session, with a length pointer.

    `keys`:   [layers, kv_heads, capacity, head_dim]
    `values`: [layers, kv_heads, capacity, value_dim]
    Positions `[0, length)` are valid; what lies beyond is stale and never read
    unmasked.
    """

    def __init__(self, shape: KVShape, capacity: int):
        self.shape = shape
        self.length = 0
        self.keys = torch.zeros(
            (shape.num_layers, shape.kv_heads, capacity, shape.head_dim),
            dtype=shape.dtype,
            device=shape.device,
        )
        self.values = torch.zeros(
            (shape.num_layers, shape.kv_heads, capacity, shape.value_dim),
            dtype=shape.dtype,
            device=shape.device,
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions: O(1), nothing is copied."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def grow(self, capacity: int) -> None:
        """Re-allocate to a larger capacity, keeping the valid positions.

        The only copy in the cache's life, and amortized: the engine grows
        geometrically. Rollback never calls it.
        """
        assert capacity > self.capacity
        old_keys, old_values = self.keys, self.values
        n = self.length
        self.keys = old_keys.new_zeros((*old_keys.shape[:2], capacity, old_keys.shape[3]))
        self.values = old_values.new_zeros((*old_values.shape[:2], capacity, old_values.shape[3]))
        self.keys[:, :, :n].copy_(old_keys[:, :, :n])
        self.values[:, :, :n].copy_(old_values[:, :, :n])


class _BatchLayer(CacheLayerMixin):
    """One decoder layer's view of a batch of sessions (see `BatchKVView`)."""

    is_sliding = False

    def __init__(self, view: "BatchKVView", layer_idx: int):
        super().__init__()
        self.view = view
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.view.write_and_read(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view.kv_length, 0

    def get_seq_length(self) -> int:
        return min(self.view.starts)

    def get_max_length(self) -> int:
        return -1


class BatchKVView(Cache):
    """A transformers `Cache` over the sessions of one batched forward pass.

    Row b of the batch belongs to `sessions[b]`; its `new_counts[b]` real query
    tokens sit at the END of the row (left padding), and they are written at
    positions `starts[b] .. starts[b] + new_counts[b] - 1` of its session.
    """

    def __init__(self, sessions: list[SessionKV], new_counts: list[int]):
        assert len(sessions) == len(new_counts) > 0
        self.sessions = sessions
        self.starts = [s.length for s in sessions]
        self.new_counts = list(new_counts)
        self.ends = [s + n for s, n in zip(self.starts, self.new_counts)]
        self.kv_length = max(self.ends)
        num_layers = sessions[0].shape.num_layers
        super().__init__(layers=[_BatchLayer(self, i) for i in range(num_layers)])

    def write_and_read(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        # key_states: [B, kv_heads, n_max, head_dim], real tokens right-aligned.
        n_max = key_states.shape[2]
        for b, session in enumerate(self.sessions):
            start, n = self.starts[b], self.new_counts[b]
            session.keys[layer, :, start : start + n].copy_(key_states[b, :, n_max - n :])
            session.values[layer, :, start : start + n].copy_(value_states[b, :, n_max - n :])
        if len(self.sessions) == 1:
            end = self.ends[0]
            s = self.sessions[0]
            return s.keys[layer, :, :end].unsqueeze(0), s.values[layer, :, :end].unsqueeze(0)
        return (
            self._gather([s.keys for s in self.sessions], layer),
            self._gather([s.values for s in self.sessions], layer),
        )

    def _gather(self, buffers: list[torch.Tensor], layer: int) -> torch.Tensor:
        # Zero padding (not stale data): a masked position must still be finite,
        # since attention weights of 0 times NaN would poison the row.
        first = buffers[0]
        out = first.new_zeros((len(buffers), first.shape[1], self.kv_length, first.shape[3]))
        for b, buf in enumerate(buffers):
            end = self.ends[b]
            out[b, :, :end].copy_(buf[layer, :, :end])
        return out

    def commit(self) -> None:
        """Advance every session's length past the tokens just written."""
        for session, end in zip(self.sessions, self.ends):
            session.length = end

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.starts)
