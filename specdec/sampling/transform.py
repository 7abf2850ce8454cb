"""The sampling transform: logits -> probabilities, identical on draft and target.

Speculative decoding is exact only if the draft's q and the target's p are both
taken AFTER the same transform, so both services call `logits_to_probs` with the
request's `SamplingParams`. Order: temperature, then top-k, then top-p (the nucleus
is measured on the distribution already cut to the top k), then renormalize.

Ranking rule, used for top-k, top-p, `argmax_tokens` and sparse truncation alike:
more likely first, and among equal values the LOWER token id first (the rule of
`torch.argmax`). So top_k=1 picks the greedy token, and the kept set never depends
on the kernel's tie order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdec.sampling.params import SamplingParams


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of logits [N, V] -> LongTensor [N].

    Ties go to the lowest token id: torch.argmax returns the first maximal index
    on every device.
    """
    assert logits.dim() == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    return logits.argmax(dim=-1)


def top_indices(values: torch.Tensor, n: int, nonnegative: bool = False) -> torch.Tensor:
    """Indices [N, n] of the n largest entries of each row of values [N, V].

    Most likely first; ties go to the lower index. Deterministic on any device:
    each entry gets a unique int64 key (its float32 value in an order-preserving
    integer form, then its reversed index), so no two keys tie and the choice at a
    tie never depends on the kernel. O(V) via topk when n < V.

    `nonnegative`: the caller vouches that every value is +0.0 or more (a
    softmax's probabilities), whose float32 bits already order as integers:
    the same indices with four operations fewer (on a GPU, four launches).
    Rows it does not hold for (a NaN with its sign bit set) may order
    differently; a row without finite mass is refused downstream anyway.
    """
    assert values.dim() == 2 and 1 <= n <= values.shape[-1], (tuple(values.shape), n)
    if nonnegative:
        ordered = values.float().view(torch.int32).long()  # [N, V]
    else:
        v = values.float() + 0.0  # -0.0 + 0.0 == +0.0: the two zeros rank as equal
        bits = v.view(torch.int32)
        # Negative floats order backwards as integers: flip their 31 low bits.
        ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # [N, V]
    vocab = values.shape[-1]
    keys = (ordered << 32) | _reversed_index(vocab, values.device)  # [N, V], unique per row
    if n < vocab:
        return keys.topk(n, dim=-1).indices
    return keys.sort(dim=-1, descending=True).indices


@functools.lru_cache(maxsize=16)
def _reversed_index(vocab: int, device: torch.device) -> torch.Tensor:
    """V-1, V-2, ..., 0 on `device`: the low half of `top_indices`' keys, made once per vocabulary and device."""
    return vocab - 1 - torch.arange(vocab, device=device)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [N, V] (any float dtype, any device) -> probabilities [N, V] float32.

    Each row is transformed independently with the same params (the N rows are
    usually the k+1 positions of one request). Greedy params give the one-hot row
    of the argmax, the temperature -> 0 limit.
    """
    assert logits.dim() == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        return F.one_hot(argmax_tokens(logits), vocab).float()
    # Shift before dividing so the top token sits at exactly 0: a tiny temperature
    # then sends the rest to -inf instead of overflowing to inf - inf = NaN.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature  # [N, V]
    n = params.top_k if 0 < params.top_k < vocab else vocab
    if n == vocab and params.top_p >= 1.0:
        return torch.softmax(scaled, dim=-1)
    order = top_indices(scaled, n)  # [N, n], most likely first
    kept = scaled.gather(-1, order)  # [N, n]
    if params.top_p < 1.0:
        kept = _nucleus(kept, params.top_p)
    filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, kept)
    return torch.softmax(filtered, dim=-1)


def _nucleus(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest prefix of sorted_logits [N, n] whose mass reaches top_p.

    A token is kept iff the mass ranked strictly above it is < top_p, so the most
    likely token (mass above it: 0) is always kept.
    """
    probs = torch.softmax(sorted_logits, dim=-1)  # [N, n]
    cumulative = torch.cumsum(probs, dim=-1)
    mass_above = F.pad(cumulative[:, :-1], (1, 0))  # [N, n], exclusive cumsum
    return sorted_logits.masked_fill(mass_above >= top_p, float("-inf"))
