"""Triton kernels of `fused_ops.py` (CUDA): one launch each where transformers
makes eight (RMSNorm), twelve (rotary embedding and the KV store's writes) or
two (SiLU times up).

Every input is a tensor, so they run inside captured CUDA graphs. Their
element-wise arithmetic rounds where transformers' bf16/fp16 ops round (each
product and sum back to the model's dtype), so the results match the
reference ops except where a sum is reduced in another order (RMSNorm's mean
of squares): there they agree to rounding.

Tested on the CPU under TRITON_INTERPRET=1 (tests/test_fused_decoder.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# No mul+add contraction into FMAs: LLVM narrows `(a * b).to(bf16)` to a bf16
# multiply and would fuse it into the next add (one rounding where transformers
# rounds twice; ~23% of rotary outputs then differ by an ulp).
_NO_FMA = dict(enable_fp_fusion=False)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _add_rms_norm_kernel(H, D, W, OUT, stride_h, stride_d, stride_o, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(D + row * stride_d + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(H.dtype.element_ty)  # the residual add, rounded
        tl.store(H + row * stride_h + cols, h, mask=mask)
    x = h.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.rsqrt(variance + eps)).to(H.dtype.element_ty)  # transformers rounds here, then scales
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + cols, out, mask=mask)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] (updated in place to hidden + delta), delta [T, H] or
    None, weight [H] -> (hidden, RMSNorm(hidden) * weight)."""
    tokens, n_cols = hidden.shape
    assert hidden.stride(1) == 1 and weight.is_contiguous(), "rows must be contiguous"
    out_dtype = torch.promote_types(weight.dtype, hidden.dtype)
    out = torch.empty((tokens, n_cols), dtype=out_dtype, device=hidden.device)
    if delta is not None:
        assert delta.shape == hidden.shape and delta.stride(1) == 1
    block = triton.next_power_of_2(n_cols)
    _add_rms_norm_kernel[(tokens,)](
        hidden, delta if delta is not None else hidden, weight, out,
        hidden.stride(0), (delta if delta is not None else hidden).stride(0), out.stride(0), n_cols, eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4, **_NO_FMA,
    )
    return hidden, out


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
    """transformers' (x * cos) + (rotate_half(x) * sin), rotate_half(x) =
    [-x2, x1], each product and the sum rounded to DTYPE."""
    a1 = (x1 * c1).to(DTYPE).to(tl.float32)
    b1 = (-x2 * s1).to(DTYPE).to(tl.float32)
    a2 = (x2 * c2).to(DTYPE).to(tl.float32)
    b2 = (x1 * s2).to(DTYPE).to(tl.float32)
    return (a1 + b1).to(DTYPE), (a2 + b2).to(DTYPE)


@triton.jit
def _rotary_store_kernel(Q, K, V, COS, SIN, KEYS, VALUES, WRITE,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
                         stride_keys_h, stride_keys_n, stride_values_h, stride_values_n,
                         Q_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                         VALUE_DIM: tl.constexpr, VDIM_P2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, HALF_P2)
    m = i < HALF
    c1 = tl.load(COS + t * stride_ct + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * stride_ct + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * stride_st + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t * stride_st + HALF + i, mask=m, other=0.0).to(tl.float32)
    if h < Q_HEADS:  # a query head: rotated in place
        q = Q + t * stride_qt + h * stride_qh
        x1 = tl.load(q + i, mask=m, other=0.0)
        x2 = tl.load(q + HALF + i, mask=m, other=0.0)
        o1, o2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c1, c2, s1, s2, Q.dtype.element_ty)
        tl.store(q + i, o1, mask=m)
        tl.store(q + HALF + i, o2, mask=m)
    else:  # a KV head: the rotated key and the value go into the store
        j = (h - Q_HEADS).to(tl.int64)
        slot = tl.load(WRITE + t).to(tl.int64)
        k = K + t * stride_kt + j * stride_kh
        x1 = tl.load(k + i, mask=m, other=0.0)
        x2 = tl.load(k + HALF + i, mask=m, other=0.0)
        o1, o2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c1, c2, s1, s2, K.dtype.element_ty)
        dest = KEYS + j * stride_keys_h + slot * stride_keys_n
        tl.store(dest + i, o1.to(KEYS.dtype.element_ty), mask=m)
        tl.store(dest + HALF + i, o2.to(KEYS.dtype.element_ty), mask=m)
        d = tl.arange(0, VDIM_P2)
        v = tl.load(V + t * stride_vt + j * stride_vh + d, mask=d < VALUE_DIM, other=0.0)
        tl.store(VALUES + j * stride_values_h + slot * stride_values_n + d, v.to(VALUES.dtype.element_ty),
                 mask=d < VALUE_DIM)


def rotary_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, write_index: torch.Tensor) -> torch.Tensor:
    """See fused_ops.rotary_and_store; q is rotated in place and returned."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    value_dim = v.shape[2]
    assert head_dim % 2 == 0 and k.shape[2] == head_dim and cos.shape[-1] == head_dim
    for x in (q, k, v, cos, sin, keys, values):
        assert x.stride(-1) == 1, "the last dimension must be contiguous"
    half = head_dim // 2
    _rotary_store_kernel[(tokens, q_heads + kv_heads)](
        q, k, v, cos, sin, keys, values, write_index,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        Q_HEADS=q_heads, HALF=half, HALF_P2=triton.next_power_of_2(half),
        VALUE_DIM=value_dim, VDIM_P2=triton.next_power_of_2(value_dim), num_warps=1, **_NO_FMA,
    )
    return q


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + expf(-x)), an accurate expf and an IEEE division, rounded
    if ACCURATE_EXP:
        e = libdevice.exp(-g)  # expf, as torch's ::exp (tl.exp is ex2.approx of g * log2(e))
    else:
        e = tl.exp(-g)  # the interpreter has no libdevice
    s = tl.div_rn(g, 1.0 + e).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (s * u).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> SiLU(gate) * up [T, I]."""
    tokens, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(1) == 1
    n_cols = width // 2
    out = torch.empty((tokens, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_mul_kernel[(tokens, triton.cdiv(n_cols, block))](gate_up, out, gate_up.stride(0), out.stride(0), n_cols,
                                                            BLOCK=block, ACCURATE_EXP=not _INTERPRETED,
                                                            num_warps=4, **_NO_FMA)
    return out
