"""Sibling projections as one product (engine/fused_linears.py): the parts
equal the separate layers bit for bit (int8, as the draft runs them), and the
shared product is only ever reused for the very same, unmodified input."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specdec.engine.fused_linears import FusedPart, SharedProduct, fuse_siblings, is_fused, replace_linears
from specdec.engine.quantize import Int8Linear, quantize_linears
from tests.conftest import tiny_model


def int8_unfused(model):
    """Every nn.Linear as its own Int8Linear, nothing fused."""
    replace_linears(model, Int8Linear)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_int8_model_computes_what_the_unfused_one_does_bit_for_bit(arch, dtype):
    model = tiny_model(arch, seed=0, init_range=0.3).to(dtype)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    fused, unfused = copy.deepcopy(model), int8_unfused(copy.deepcopy(model))
    assert quantize_linears(fused) == linears
    assert is_fused(fused) and not any(isinstance(m, nn.Linear) for m in fused.modules())
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, SharedProduct) for m in fused.modules()) == 2 * layers  # qkv and gate/up
    ids = torch.tensor([[5, 9, 17, 30, 31, 2, 8], [100, 3, 4, 5, 6, 7, 1]])
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, unfused(ids).logits)
        assert torch.equal(fused(ids[:1, :3]).logits, unfused(ids[:1, :3]).logits)


def test_a_part_reuses_the_product_only_for_the_same_unmodified_input():
    torch.manual_seed(0)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = nn.Linear(8, 6), nn.Linear(8, 2), nn.Linear(8, 2)
    separate = copy.deepcopy(parent)
    calls = []
    assert fuse_siblings(parent, lambda linear: linear.register_forward_hook(lambda *a: calls.append(1)) and linear) == 1
    assert all(isinstance(getattr(parent, n), FusedPart) for n in ("q_proj", "k_proj", "v_proj"))
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        def check(inp, name):
            torch.testing.assert_close(getattr(parent, name)(inp), getattr(separate, name)(inp), rtol=1e-6, atol=1e-6)

        check(x, "q_proj"), check(x, "k_proj"), check(x, "v_proj")
        assert len(calls) == 1  # one product for the three
        shared = parent.q_proj.shared[0]
        assert shared._input is None and shared._output is None  # all three served: nothing held
        check(x, "q_proj"), check(y, "k_proj")  # another input: computed afresh
        assert len(calls) == 3
        x.mul_(2)  # the same tensor, modified in place: computed afresh
        check(x, "v_proj")
        assert len(calls) == 4


def test_siblings_that_differ_in_bias_or_input_size_are_left_alone():
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=True)
    assert fuse_siblings(parent, Int8Linear) == 0 and type(parent.gate_proj) is nn.Linear
    parent.up_proj = nn.Linear(6, 4, bias=False)
    assert fuse_siblings(parent, Int8Linear) == 0
