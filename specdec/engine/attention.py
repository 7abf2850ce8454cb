"""Attention over the KV store, read in place (see kv_store.py).

The engine registers `store_attention` with transformers under the name
`ATTENTION_NAME` and sets the model to use it, so every attention layer of any
architecture that goes through transformers' attention interface (Llama,
Qwen2, GPT-2, ... all current decoder LMs) calls it with the store layer as
its keys/values and the step's `StepLayout` as a keyword argument.

Two kernels compute the same thing, one query token at a time: token t of the
step attends to keys at flat indices key_base[t] + 0..position[t].

- `sdpa` (the reference; any device): per session, one
  `scaled_dot_product_attention` call over a view of the slot's valid prefix.
  Cost grows with each session's context; a Python loop over sessions, which
  is nothing next to a CPU forward pass but cannot be captured in a graph.
- `triton` (CUDA): one fused kernel for the whole step (`triton_attention.py`)
  whose inputs are tensors only, so a step runs inside a captured CUDA graph.

Chosen over FlexAttention (whose block mask would have to be rebuilt for each
step from the slots and lengths, and whose decode kernel is selected by
torch.compile heuristics) and over KV-length buckets (which would gather each
session's prefix into a padded batch): the fused kernel reads exactly each
token's prefix and nothing else. flash-attn and FlashInfer cannot be
installed here.

Called without a layout (a plain `model(input_ids)` call, as tests make for
their reference logits), it is ordinary causal SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from specdec.engine.kv_store import RowSpan, StepLayout

ATTENTION_NAME = "specdec_store"
STEP_KWARG = "specdec_step"


def store_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function contract: query [1, Hq, T, D]; with a
    layout, key/value are the store layer [Hkv, N, D]; returns
    ([1, T, Hq, D], None)."""
    layout: StepLayout | None = kwargs.pop(STEP_KWARG, None)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layout.kernel == "triton":
        from specdec.engine.triton_attention import attend

        out = attend(query[0].transpose(0, 1), key, value, layout.key_base, layout.position, scaling)
        return out.unsqueeze(0), None
    return sdpa_rows(query, key, value, layout.rows, scaling), None


def sdpa_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: list[RowSpan],
              scaling: float) -> torch.Tensor:
    """The reference kernel: query [1, Hq, T, D], key/value [Hkv, N, D] ->
    [1, T, Hq, D].

    Grouped-query attention without copying keys: the `group` query heads
    that share a KV head are folded into the query length, [Hkv, group·n, D],
    so SDPA reads each KV head once, in place (enable_gqa would send the CPU
    to its math kernel, which repeats the keys per query head)."""
    q_heads, kv_heads = query.shape[1], key.shape[0]
    group = q_heads // kv_heads
    q = query[0]
    outs = []
    for row in rows:
        n = row.stop - row.start
        if n == 0:
            continue
        k = key[:, row.base : row.base + row.end]  # [Hkv, end, D]: a view, no copy
        v = value[:, row.base : row.base + row.end]
        qr = q[:, row.start : row.stop].reshape(kv_heads, group * n, q.shape[-1])  # [Hkv, group·n, D]
        mask = None if row.mask is None else row.mask.repeat(group, 1)  # [group·n, end]
        # 4D: the fused CPU kernel takes [batch, heads, length, dim] only.
        o = F.scaled_dot_product_attention(qr[None], k[None], v[None], attn_mask=mask, scale=scaling)[0]
        # reshape, not view: CUDA's SDPA kernels may return a transposed layout
        outs.append(o.reshape(q_heads, n, v.shape[-1]))  # [Hkv, group·n, Dv] -> [Hq, n, Dv]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [Hq, T, Dv]
    return out.transpose(0, 1).unsqueeze(0)


def row_mask(n: int, first_position: int, device) -> torch.Tensor | None:
    """[n, first_position + n] bool: query j (at first_position + j) sees keys
    0..first_position + j. None for one query, which sees every key."""
    if n == 1:
        return None
    end = first_position + n
    return (torch.arange(end, device=device).view(1, end)
            <= (first_position + torch.arange(n, device=device)).view(n, 1))


def register() -> str:
    """Make `ATTENTION_NAME` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, store_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def use_store_attention(model) -> None:
    """Route every attention layer of `model` through `store_attention`."""
    name = register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name
