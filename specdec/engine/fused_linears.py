"""Replacing a model's linear layers: each on its own (`replace_linears`, what
int8 and packed layers use) or siblings that read the same input as one
product (`fuse_siblings`).

A transformer layer projects the same hidden states three times (q, k and v)
and its MLP twice (gate and up). On a CPU, a good part of a small model's
int8 step is the fixed cost of each product (quantizing the activations, the
call, the casts around it): the three attention projections of the 0.5B cost
245 us one by one and 93 us as one product (docs/benchmarks.md "Packed bf16
linears and fused int8 projections"). `fuse_siblings` stacks such siblings'
weights into one `nn.Linear` before it is converted (to int8), and each
sibling becomes a `FusedPart` that returns its columns of the one product.

Each output channel keeps its own weights, bias and (int8) scale, and every
row its own activation range, so the parts equal the separate products bit
for bit; the model computes exactly what it computed unfused.

The product is shared by identity: the first part called with a tensor
computes it, and its siblings called with the same tensor (same object,
unmodified) take their columns of it. A part called with another tensor
computes the product afresh, so a caller that does not call the siblings in
step gets correct results, only not the saving.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# Sibling projections that read the same input, by the names transformers gives them.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedProduct(nn.Module):
    """The one product of several fused siblings, computed once per input."""

    def __init__(self, layer: nn.Module, parts: int):
        super().__init__()
        self.layer = layer
        self.parts = parts
        self._input: torch.Tensor | None = None
        self._version = -1
        self._output: torch.Tensor | None = None
        self._served = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        version = _version(x)
        if x is not self._input or version != self._version:
            self._output = self.layer(x)
            self._input, self._version, self._served = x, version, 0
        output = self._output
        self._served += 1
        if self._served >= self.parts:  # every sibling has had its columns: hold no activations
            self._input = self._output = None
        return output


def _version(x: torch.Tensor) -> int:
    """The tensor's in-place modification count; inference tensors keep none
    (-2: identity alone then decides, and no transformers layer modifies its
    input between two sibling projections)."""
    return -2 if x.is_inference() else x._version


class FusedPart(nn.Module):
    """One sibling's columns [start, stop) of a SharedProduct."""

    def __init__(self, shared: SharedProduct, start: int, stop: int, in_features: int):
        super().__init__()
        self.shared = [shared]  # a list: registered once, under the first part only
        self.start, self.stop = start, stop
        self.in_features, self.out_features = in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared[0](x)[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of one product with its siblings"


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    first = linears[0]
    has_bias = first.bias is not None
    # skip_init: no random initialization to overwrite (and no draw from the caller's generator)
    fused = torch.nn.utils.skip_init(nn.Linear, first.in_features, sum(m.out_features for m in linears),
                                     bias=has_bias, dtype=first.weight.dtype, device=first.weight.device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if has_bias:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return fused


def fuse_siblings(model: nn.Module, convert: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace each group of sibling nn.Linears (SIBLINGS: same input size,
    all with a bias or none) by FusedParts of one product, `convert`ed from
    their stacked weights (e.g. to an Int8Linear); returns how many groups."""
    groups = 0
    for module in list(model.modules()):
        for names in SIBLINGS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(m) is nn.Linear for m in linears):
                continue
            if len({m.in_features for m in linears}) > 1 or len({m.bias is None for m in linears}) > 1:
                continue
            shared = SharedProduct(convert(_stacked(linears)), len(linears))
            start = 0
            for i, (name, linear) in enumerate(zip(names, linears)):
                part = FusedPart(shared, start, start + linear.out_features, linear.in_features)
                if i == 0:
                    part.add_module("product", shared)  # the weights belong to the model once
                setattr(module, name, part)
                start += linear.out_features
            groups += 1
    return groups


def replace_linears(model: nn.Module, convert: Callable[[nn.Linear], nn.Module],
                    where: Callable[[nn.Linear], bool] = lambda linear: True) -> int:
    """Replace every nn.Linear of `model` for which `where` holds by
    `convert(linear)` (in place); returns how many were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and where(child):
                setattr(module, name, convert(child))
                replaced += 1
    return replaced


def is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedPart) for m in model.modules())
