"""bf16 linear layers with weights pre-packed for oneDNN (`--packed-linears`).

On a CPU, `F.linear` in bf16 hands each product to oneDNN, which re-blocks
the weight matrix into its kernel's layout on every call: a decode step of
the 1.5B target reads its weights at ~11 GB/s (docs/benchmarks.md "Packed
bf16 linears"). Blocking each weight once, at load time, and calling the
kernel on the blocked copy (`mkldnn._linear_pointwise`, the path inductor
takes for frozen bf16 linears on the CPU) skips that work.

The kernel and its order of summation are the same, so the products are the
same, bit for bit: `packing_is_exact()` checks that on the machine at start-up
(a row alone and rows in a batch against `F.linear`), and `auto` packs only
where it holds. A target with packed linears is therefore still exactly the
target model; this is a faster way to run it, not another model.

bf16 on the CPU only: fp32 products through the packed path differ from
`F.linear`'s (another kernel), so fp32, the exactness reference, keeps
`F.linear`; fp16 packing needs CPU features this project does not assume.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engine.fused_linears import replace_linears

log = logging.getLogger(__name__)

PACK_ROWS = 8  # the number of rows the weights' blocking is chosen for (see PackedLinear)


class PackedLinear(nn.Module):
    """`nn.Linear` (bf16, CPU) whose weight is blocked once for oneDNN's kernel;
    same inputs, same outputs, bit for bit."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        # oneDNN picks the blocking for an expected number of rows. 8 read
        # the 1.5B's MLP weights fastest at 1 and 5 rows (a decode step, a
        # verify at k = 4) and no slower at 40 (a sweep of hints 1-32 over
        # 24 such matrices, docs/benchmarks.md "Packed bf16 linears"); every hint
        # gives F.linear's products, bit for bit.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS),
                             persistent=False)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    @property
    def weight_nbytes(self) -> int:
        """Bytes a forward reads for the weights."""
        return self.in_features * self.out_features * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 packed (oneDNN)"


def bf16_packing_runs() -> bool:
    """Whether oneDNN computes bf16 products on this CPU at all (it needs
    AVX512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has neither)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.lru_cache(maxsize=None)
def packing_is_exact() -> bool:
    """Whether packed bf16 products equal F.linear's here, bit for bit, for a
    row alone and for rows in a batch (False where oneDNN cannot pack)."""
    if not bf16_packing_runs():
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        for n_in, n_out in ((64, 96), (160, 48)):
            linear = nn.Linear(n_in, n_out, dtype=torch.bfloat16)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(n_out, n_in, generator=gen) * 0.1)
                linear.bias.copy_(torch.randn(n_out, generator=gen) * 0.1)
            packed = PackedLinear(linear)
            x = torch.randn(9, n_in, generator=gen).to(torch.bfloat16)
            with torch.no_grad():
                for rows in (x[:1], x[:5], x):
                    if not torch.equal(packed(rows), F.linear(rows, linear.weight, linear.bias)):
                        return False
    except RuntimeError as exc:  # no bf16 support in this build or on this CPU
        log.debug("oneDNN cannot pack bf16 linears here: %s", exc)
        return False
    return True


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing is for bf16 models on the CPU (see the module docstring)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def wants_packing(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """`--packed-linears`: auto packs bf16 CPU models where packing is exact;
    on insists (and fails loudly where it cannot run); off never packs."""
    if setting == "off":
        return False
    applicable = packable(device, dtype)
    if setting == "on":
        if not applicable:
            raise ValueError("--packed-linears on runs bf16 models on the CPU only "
                             f"(this model: {dtype} on {device}); use auto or off")
        if not packing_is_exact():
            raise ValueError("--packed-linears on: oneDNN's packed bf16 products differ from F.linear's "
                             "on this machine (or cannot run); use auto or off")
        return True
    return applicable and packing_is_exact()


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 nn.Linear of `model` by a PackedLinear (in place);
    returns how many were replaced. Other layers (int8 ones) stay."""
    return replace_linears(model, PackedLinear, where=lambda linear: linear.weight.dtype == torch.bfloat16)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
