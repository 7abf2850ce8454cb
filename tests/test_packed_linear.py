"""bf16 linears with pre-packed oneDNN weights (`--packed-linears`,
engine/packed_linear.py): the same products as F.linear, bit for bit, so an
engine running them computes exactly the model; when they are used, and the
orders they must come in with trimming and int8."""
from __future__ import annotations

import copy

import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.engine.engine import ExtendItem
from specdec.engine.packed_linear import PackedLinear, is_packed, pack_linears, packing_is_exact, wants_packing
from specdec.engine.quantize import Int8Linear
from tests.conftest import TINY_VOCAB, tiny_engine, tiny_model
from tests.harness import running_system

# Decided apart from the code under test (oneDNN runs bf16 here). Whether the
# packed products are also bit-identical to F.linear's depends on the CPU
# (packing_is_exact, checked against a direct comparison below); where they
# are, the tests ask for equality, elsewhere for F.linear's accuracy.
needs_packing = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                        and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                                   reason="oneDNN has no bf16 on this CPU")
CPU = torch.device("cpu")


def same_or_as_accurate(got, want, reference=None):
    """Equal where packing is exact; otherwise close to `want` and, given the
    float32 `reference`, no further from it than twice `want` is."""
    if packing_is_exact():
        assert torch.equal(got, want)
        return
    if reference is not None:
        bound = 2 * (want.float() - reference).abs().max() + 1e-6
        assert (got.float() - reference).abs().max() <= bound
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)


@needs_packing
@pytest.mark.parametrize("n_in,n_out,bias", [(64, 96, True), (896, 256, False), (40, 1000, True)])
def test_packed_products_equal_f_linear_alone_and_in_a_batch(n_in, n_out, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(n_in, n_out, bias=bias)
    reference_linear = copy.deepcopy(linear)
    linear = linear.to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(2, 17, n_in).to(torch.bfloat16)
    with torch.no_grad():
        got, want = packed(x), linear(x)
        reference = reference_linear.to(torch.bfloat16).float()(x.float())  # bf16 weights, float32 products
        alone = packed(x[:1, :1])
    assert got.shape == want.shape == (2, 17, n_out) and got.dtype == torch.bfloat16
    same_or_as_accurate(got, want, reference)
    same_or_as_accurate(alone[0, 0], got[0, 0])
    assert packed.weight_nbytes == n_in * n_out * 2


@needs_packing
def test_the_start_up_check_agrees_with_a_direct_comparison_on_model_shapes():
    torch.manual_seed(1)
    equal = True
    for n_in, n_out in ((896, 4864), (4864, 896), (1536, 256)):
        linear = torch.nn.Linear(n_in, n_out).to(torch.bfloat16)
        x = torch.randn(7, n_in).to(torch.bfloat16)
        with torch.no_grad():
            packed = PackedLinear(linear)
            equal &= torch.equal(packed(x), linear(x)) and torch.equal(packed(x[:1]), linear(x[:1]))
    assert packing_is_exact() == equal
    assert wants_packing("auto", CPU, torch.bfloat16) == equal


def bf16_pair(arch="qwen2"):
    model = tiny_model(arch, seed=0, init_range=0.3).to(torch.bfloat16)
    plain = tiny_engine(model=copy.deepcopy(model), dtype="bfloat16", packed_linears="off")
    packed = tiny_engine(model=model, dtype="bfloat16")
    packed.pack_weights()
    return plain, packed


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_engine_with_packed_linears_gives_the_same_logits_for_every_step(arch):
    plain, packed = bf16_pair(arch)
    assert is_packed(packed.model) and not is_packed(plain.model)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.model.modules())
    prompts = ([5, 9, 17, 30, 31, 2, 8, 40, 41], [100, 3], [7] * 30)
    results = []
    for engine in (plain, packed):
        ids = [engine.open_session(p).id for p in prompts]
        steps = [
            engine.extend([ExtendItem(ids[0], None, [4, 5, 6], 4), ExtendItem(ids[1], None, [], 1),
                           ExtendItem(ids[2], None, [8, 9], 3)]),  # a verify batch of mixed lengths
            engine.extend([ExtendItem(ids[1], None, [11], 1)]),  # a decode step alone
        ]
        engine.rollback(ids[0], 10)
        steps.append(engine.extend([ExtendItem(ids[0], None, [12, 13], 2)]))  # after a rollback
        results.append([row for step in steps for row in step])
    for want, got in zip(*results):
        same_or_as_accurate(got, want)


@needs_packing
def test_greedy_speculation_with_packed_engines_equals_the_target_alone():
    target = tiny_model(seed=0, init_range=0.3).to(torch.bfloat16)
    reference, *engines = [tiny_engine(model=copy.deepcopy(target), dtype="bfloat16") for _ in range(3)]
    for e in (reference, *engines):
        e.pack_weights()  # the target alone as the target service runs it, packed
    prompt = [5, 9, 17]
    want = []  # the target alone, greedy, one token per step
    s = reference.open_session(prompt)
    logits = reference.extend([ExtendItem(s.id, None, [], 1)])[0]
    for _ in range(12):
        tok = int(logits[-1].argmax())
        want.append(tok)
        logits = reference.extend([ExtendItem(s.id, None, [tok], 1)])[0]
    with running_system(engines[0], engines[1]) as system:
        result = system.client.complete(prompt, max_tokens=12, temperature=0, num_draft_tokens=3)
    assert result.token_ids == want[: len(result.token_ids)] and len(result.token_ids) == 12
    assert result.stats.accepted_tokens > 0  # the draft is the target: it must be accepted


def test_auto_packs_bf16_on_the_cpu_only_and_on_says_why_it_cannot():
    assert not wants_packing("auto", CPU, torch.float32)
    assert not wants_packing("auto", torch.device("cuda"), torch.bfloat16)
    assert not wants_packing("off", CPU, torch.bfloat16)
    assert wants_packing("auto", CPU, torch.bfloat16) == packing_is_exact()
    with pytest.raises(ValueError, match="bf16 models on the CPU only"):
        wants_packing("on", CPU, torch.float32)
    with pytest.raises(ValueError, match="packed_linears must be auto, on or off"):
        EngineConfig(packed_linears="yes").validate()
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(device="cuda", packed_linears="on").validate()


def test_a_float32_engine_loaded_with_auto_keeps_f_linear(tmp_path):
    engine = tiny_engine()  # float32, packed_linears auto
    assert not is_packed(engine.model)
    with pytest.raises(ValueError, match="bf16 models on the CPU"):
        engine.pack_weights()


def test_a_bf16_engine_on_a_cpu_without_onednn_bf16_is_refused_in_words(monkeypatch):
    """Where oneDNN has no bf16 (an AVX2-only CPU) packing is refused with a
    reason, not oneDNN's own error; auto then leaves the model unpacked."""
    from specdec.engine import packed_linear, weight_forms

    monkeypatch.setattr(weight_forms, "bf16_packing_runs", lambda: False)
    monkeypatch.setattr(packed_linear, "bf16_packing_runs", lambda: False)
    packed_linear.packing_is_exact.cache_clear()
    try:
        engine = tiny_engine(model=tiny_model(seed=0, init_range=0.3).to(torch.bfloat16), dtype="bfloat16")
        with pytest.raises(ValueError, match="this CPU lacks"):
            engine.pack_weights()
        assert not is_packed(engine.model)
        assert not wants_packing("auto", CPU, torch.bfloat16)
        with pytest.raises(ValueError, match="differ from F.linear's on this machine .or cannot run."):
            wants_packing("on", CPU, torch.bfloat16)
    finally:
        packed_linear.packing_is_exact.cache_clear()


@needs_packing
def test_trim_and_quantize_come_before_packing_and_int8_layers_stay_int8():
    engine = tiny_engine(model=tiny_model(seed=0, init_range=0.3).to(torch.bfloat16), dtype="bfloat16")
    engine.restrict_output(torch.arange(0, TINY_VOCAB, 3))
    engine.pack_weights()
    with pytest.raises(ValueError, match="before quantizing or packing"):
        engine.restrict_output(torch.arange(0, TINY_VOCAB, 2))
    with pytest.raises(ValueError, match="before packing"):
        engine.quantize_weights("int8")
    quantized = tiny_engine(model=tiny_model(seed=0, init_range=0.3).to(torch.bfloat16), dtype="bfloat16")
    quantized.quantize_weights("int8")
    assert pack_linears(quantized.model) == 0
    assert any(isinstance(m, Int8Linear) for m in quantized.model.modules())


def test_packing_leaves_float32_linears_alone():
    model = tiny_model(seed=0)
    assert pack_linears(model) == 0 and not is_packed(model)


@needs_packing
def test_the_hf_baselines_pack_only_when_asked_and_generate_the_same_tokens(tmp_path):
    from specdec.bench.hf_baselines import HFBaselines

    tiny_model("llama", seed=3, init_range=0.2).save_pretrained(tmp_path / "target")
    tiny_model("llama", seed=3, init_range=0.2, layers=1).save_pretrained(tmp_path / "draft")
    runs = {}
    for packed in ("off", "auto"):
        cfgs = [EngineConfig(model=str(tmp_path / role), dtype="bfloat16") for role in ("target", "draft")]
        hf = HFBaselines(*cfgs, packed_linears=packed)
        assert hf.packed == (packed == "auto" and packing_is_exact()) == is_packed(hf.target) == is_packed(hf.draft)
        runs[packed] = [hf.generate([5, 9, 17, 30], max_tokens=10, temperature=0, seed=0, kind=kind)["token_ids"]
                        for kind in ("hf", "hf-assisted")]
    assert all(len(ids) == 10 for ids in runs["off"])
    assert runs["off"] == runs["auto"]  # packed or not (auto packs only where exact), the same tokens
