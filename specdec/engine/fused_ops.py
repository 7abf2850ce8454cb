"""The few element-wise pieces of a Llama-family layer, each as one operation.

A decode step of a small model on a GPU costs what its kernels cost to launch
and run, not what its arithmetic costs: the 0.5B draft's step replayed as a
CUDA graph took 3.05 ms on an H100 against a 0.33 ms bandwidth floor (issue
14). transformers runs one layer as ~42 launches (counted: `python -m
specdec.bench.kernel_count`; docs/benchmarks.md): RMSNorm alone is eight (casts, pow, mean,
add, rsqrt, two products), rotary embedding ten. `fused_decoder.py` runs a
layer as nine, with the three pieces here:

- `add_rms_norm`: the residual add and the next RMSNorm;
- `rotary_and_store`: rotary embedding of the queries and keys, and the
  step's keys and values written into the KV store;
- `silu_mul`: SiLU of the gate times the up projection.

Each has a reference in torch ops, which repeats transformers' arithmetic
op for op (the same casts and roundings: on the CPU the fused decoder computes
exactly what transformers computes), and a Triton kernel for CUDA
(`triton_fused.py`) that keeps the same roundings where they are element-wise
(no multiply-add contraction: transformers rounds the product first); its
RMSNorm sums in another order, so it agrees to rounding, not bit for bit (as
the graphs and the batched steps already do; the identity rate is what the GPU
tests report).
"""
from __future__ import annotations

import torch


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 use_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, RMSNorm of it): the new residual stream and the next
    sublayer's input. hidden, delta [T, H]; delta None: no add (the first
    layer). May update `hidden` in place."""
    if use_triton:
        from specdec.engine.triton_fused import add_rms_norm as kernel

        return kernel(hidden, delta, weight, eps)
    if delta is not None:
        hidden = hidden + delta
    x = hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return hidden, weight * x.to(hidden.dtype)


def rotary_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, write_index: torch.Tensor,
                     use_triton: bool = False) -> torch.Tensor:
    """Rotary embedding of q [T, Hq, D] and k [T, Hkv, D] (cos, sin [T, D]),
    the rotated keys and v [T, Hkv, Dv] written into the store layer
    (keys [Hkv, N, D], values [Hkv, N, Dv]) at write_index [T]. Returns the
    rotated queries."""
    if use_triton:
        from specdec.engine.triton_fused import rotary_and_store as kernel

        return kernel(q, k, v, cos, sin, keys, values, write_index)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    keys.index_copy_(1, write_index, k.transpose(0, 1).to(keys.dtype))
    values.index_copy_(1, write_index, v.transpose(0, 1).to(values.dtype))
    return q


def silu_mul(gate_up: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """SiLU(gate) * up, for gate_up [T, 2I] = [gate | up] -> [T, I]."""
    if use_triton:
        from specdec.engine.triton_fused import silu_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
