"""The KV store: one static buffer per model, divided into session slots.

At start-up the engine allocates, from its memory budget, one keys and one
values tensor for all layers and all sessions:

    keys:   [layers, kv_heads, num_slots * slot_tokens + 1, head_dim]
    values: [layers, kv_heads, num_slots * slot_tokens + 1, value_dim]

Slot s holds positions [0, slot_tokens) of one session at flat indices
[s * slot_tokens, (s + 1) * slot_tokens); the last index is a scratch
position that padding tokens of a fixed-shape step write to. A session is a
slot and a length: rollback moves the length and copies nothing, and a step
writes each new token's keys/values in place at `slot * slot_tokens + position`
(`StepLayout.write_index`, a tensor, so the same code runs inside a captured
CUDA graph). Attention then reads each session's valid prefix where it lies
(`attention.py`): nothing is gathered, padded or copied per step, and a
step's cost grows with the context, not with the store's size.

Why slots and not pages: every session owns one contiguous region, so the
reference attention (one SDPA call per session over a view of its prefix)
runs anywhere, the CPU included, and the fused kernel needs no page table.
The price is that each session reserves `--max-context` tokens: the budget
divided by that is the number of sessions that fit.

The flat layout (slots along one token axis) lets a fused kernel address any
token of any session by one integer, and a transformers `Cache` (`StoreCache`)
hand the store to the model's attention layers unchanged.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.errors import ResourceExhausted


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


def slots_for_budget(shape: KVShape, slot_tokens: int, budget_bytes: int, max_sessions: int) -> int:
    """How many session slots of slot_tokens tokens a byte budget holds (at
    most max_sessions); raises ResourceExhausted if not even one."""
    per_slot = shape.bytes_per_token * slot_tokens
    # The store holds one position more than its slots: the scratch position padding tokens read.
    slots = min(max_sessions, (budget_bytes - shape.bytes_per_token) // per_slot)
    if slots < 1:
        raise ResourceExhausted(
            f"the KV budget of {budget_bytes} bytes holds no session of {slot_tokens} tokens "
            f"({per_slot} bytes each): raise --max-kv-bytes or lower --max-context"
        )
    return int(slots)


class KVStore:
    """Session slots in one pre-allocated buffer per model (see module doc)."""

    def __init__(self, shape: KVShape, num_slots: int, slot_tokens: int):
        assert num_slots >= 1 and slot_tokens >= 1, (num_slots, slot_tokens)
        self.shape = shape
        self.num_slots = num_slots
        self.slot_tokens = slot_tokens
        self.scratch_index = num_slots * slot_tokens
        size = self.scratch_index + 1
        # torch.empty: on a CPU the pages are only touched (and become
        # resident) as sessions write them. Stale positions are never read
        # unmasked; the scratch position is zeroed, since padding tokens read it.
        self.keys = torch.empty((shape.num_layers, shape.kv_heads, size, shape.head_dim),
                                dtype=shape.dtype, device=shape.device)
        self.values = torch.empty((shape.num_layers, shape.kv_heads, size, shape.value_dim),
                                  dtype=shape.dtype, device=shape.device)
        self.keys[:, :, self.scratch_index].zero_()
        self.values[:, :, self.scratch_index].zero_()
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def bytes_per_slot(self) -> int:
        return self.shape.bytes_per_token * self.slot_tokens

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ResourceExhausted(
                f"KV cache budget exhausted: all {self.num_slots} session slots of {self.slot_tokens} tokens "
                f"are in use (close sessions, lower --max-context, or raise --max-kv-bytes)"
            )
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, slot
        self._free.append(slot)

    def base(self, slot: int) -> int:
        """Flat index of position 0 of a slot."""
        return slot * self.slot_tokens


@dataclass
class RowSpan:
    """One session's tokens in a flattened step (host-side, for the
    reference attention): tokens [start, stop) of the step, written at
    positions [first_position, first_position + stop - start) of the slot
    whose flat base index is `base`."""

    start: int
    stop: int
    base: int
    first_position: int
    # [n, end] bool: which keys each query may see; None when n == 1 (it
    # sees all `end` keys of its session).
    mask: torch.Tensor | None = None

    @property
    def end(self) -> int:
        """Keys of the session visible after this step: its new length."""
        return self.first_position + self.stop - self.start


@dataclass
class StepLayout:
    """Where each token of one forward pass lives in the store.

    The step's T tokens are the sessions' new tokens, concatenated (no padding
    between sessions; a captured graph pads the end with scratch tokens).
    Device tensors, one entry per token:
      write_index [T] int64: flat store index its keys/values are written to;
      key_base    [T] int64: flat index of position 0 of its session's slot;
      position    [T] int64: its position; it sees keys at positions 0..position.
    """

    rows: list[RowSpan]
    write_index: torch.Tensor
    key_base: torch.Tensor
    position: torch.Tensor
    # Which attention computes this step ("sdpa" per session, or "triton").
    kernel: str = "sdpa"


class _StoreLayer(CacheLayerMixin):
    """One decoder layer's access to the store."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "StoreCache", layer_idx: int):
        super().__init__()
        # Weak: a strong reference back would make every step's cache a cycle
        # that only the garbage collector frees (its layout's device tensors too).
        self.cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.write(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        # The store's attention builds no mask from these: reporting a square
        # causal shape lets transformers skip allocating one.
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class StoreCache(Cache):
    """A transformers `Cache` that writes a step's keys/values into the store
    at `layout.write_index` and hands attention the whole store layer,
    `[kv_heads, store_tokens, head_dim]`, to read in place."""

    is_compileable = False

    def __init__(self, store: KVStore, layout: StepLayout):
        self.store = store
        self.layout = layout
        super().__init__(layers=[_StoreLayer(self, i) for i in range(store.shape.num_layers)])

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        # key_states: [1, kv_heads, T, head_dim]
        keys, values = self.store.keys[layer], self.store.values[layer]
        keys.index_copy_(1, self.layout.write_index, key_states[0].to(keys.dtype))
        values.index_copy_(1, self.layout.write_index, value_states[0].to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
