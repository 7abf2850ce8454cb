"""A fused attention kernel over the KV store, in Triton (CUDA).

One program per (query token, KV head): it loads the query rows of the
`group` query heads that share that KV head (grouped-query attention), walks
the token's session prefix, key_base[t] + 0..position[t], in blocks of
BLOCK_N keys with an online softmax, and writes their outputs. Every input is
a tensor, so the kernel can be captured in a CUDA graph whose steps differ
only in the values of key_base and position.

Verification of k drafts makes k + 1 query tokens of one session, each
reading that session's prefix: the prefix is read k + 1 times. For the
contexts of speculative decoding (a few thousand tokens) that is small next
to the weights a step reads; a split-KV variant is the next step for long
contexts.

Tested on the CPU under TRITON_INTERPRET=1 (tests/test_kv_store.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_attention_kernel(
    Q, K, V, O, KEY_BASE, POSITION, scale,
    stride_qt, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    VALUE_DIM: tl.constexpr, VDIM_P2: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # int64 offsets: a large store is past 2**31 elements
    kv_head = tl.program_id(1).to(tl.int64)
    base = tl.load(KEY_BASE + t).to(tl.int64)
    position = tl.load(POSITION + t).to(tl.int64)

    heads = kv_head * GROUP + tl.arange(0, GROUP_P2)
    head_ok = tl.arange(0, GROUP_P2) < GROUP
    dims = tl.arange(0, DIM_P2)
    vdims = tl.arange(0, VDIM_P2)
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # [G, D]

    m_i = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, VDIM_P2], dtype=tl.float32)
    k_ptr = K + kv_head * stride_kh
    v_ptr = V + kv_head * stride_vh
    for start in range(0, position + 1, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        valid = offs <= position
        k = tl.load(k_ptr + (base + offs)[:, None] * stride_kn + dims[None, :],
                    mask=valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (base + offs)[:, None] * stride_vn + vdims[None, :],
                    mask=valid[:, None] & (vdims[None, :] < VALUE_DIM), other=0.0)  # [N, Dv]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + t * stride_ot + heads[:, None] * stride_oh + vdims[None, :], out.to(O.dtype.element_ty),
             mask=head_ok[:, None] & (vdims[None, :] < VALUE_DIM))


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_base: torch.Tensor,
           position: torch.Tensor, scale: float, block_n: int = 64) -> torch.Tensor:
    """q [T, Hq, D] (any strides, last dim contiguous), key [Hkv, N, D],
    value [Hkv, N, Dv], key_base/position [T] integers -> [T, Hq, Dv]."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, _, value_dim = value.shape
    assert q_heads % kv_heads == 0, (q_heads, kv_heads)
    assert q.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    group = q_heads // kv_heads
    out = torch.empty((tokens, q_heads, value_dim), dtype=q.dtype, device=q.device)
    # tl.dot needs every block dimension >= 16.
    p2 = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731
    _store_attention_kernel[(tokens, kv_heads)](
        q, key, value, out, key_base, position, scale,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P2=p2(group), HEAD_DIM=head_dim, DIM_P2=p2(head_dim),
        VALUE_DIM=value_dim, VDIM_P2=p2(value_dim), BLOCK_N=block_n,
        # fp32 stays fp32: tl.dot's default runs it as TF32 (10-bit mantissas).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
