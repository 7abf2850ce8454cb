"""An int8 draft (`--quantize int8`, engine/quantize.py): the layer against a
float linear, the engine computing the quantized model, the draft's q being
the quantized model's own distribution, exact speculative decoding on top of
it (greedy identity, the sampled distribution, with a trimmed head too), and
the target refusing it."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from scipy.stats import chisquare

from specdec.bench.step_costs import weight_bytes
from specdec.engine.config import EngineConfig
from specdec.engine.draft_vocab import SubsetHead
from specdec.engine.engine import ExtendItem
from specdec.engine.quantize import Int8Linear, is_quantized, quantize_linears
from specdec.rpc.session_limits import SessionLimits
from specdec.sampling.params import SamplingParams
from specdec.sampling.sparse import truncate
from specdec.sampling.transform import logits_to_probs
from tests.conftest import TINY_VOCAB, tiny_engine, tiny_model
from tests.harness import complete_seeds, running_draft, running_system
from tests.test_orchestrator import greedy_reference, perturbed, stats_model
from tests.test_services import open_session, propose


def quantized_copy(model):
    """The model as the engine runs it with --quantize int8."""
    q = copy.deepcopy(model)
    quantize_linears(q)
    return q


def test_int8_linear_is_close_to_the_linear_and_a_row_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    qlin = Int8Linear(linear)
    x = torch.randn(5, 64)
    x[1] *= 100  # one token with a much larger range than the others
    with torch.no_grad():
        want, got = linear(x), qlin(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert rel.max() < 0.05, rel  # per-token activation ranges: the small rows keep their precision
    assert (got != want).any(), "the product must be the int8 one, not the float one"
    with torch.no_grad():
        alone = torch.cat([qlin(x[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    assert qlin.weight_nbytes == 64 * 48 + 8 * 48


def test_bf16_linear_keeps_its_dtype():
    linear = torch.nn.Linear(32, 16).to(torch.bfloat16)
    out = Int8Linear(linear)(torch.randn(2, 3, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_engine_computes_the_quantized_model(arch):
    model = tiny_model(arch, seed=0, init_range=0.3)
    engine = tiny_engine(model=copy.deepcopy(model))
    engine.quantize_weights("int8")
    assert is_quantized(engine.model) and engine.quantized == "int8"
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.model.modules())
    seq = [5, 9, 17, 30, 31, 2, 8]
    s = engine.open_session(seq[:4])
    got = engine.extend([ExtendItem(s.id, None, seq[4:], 4)])[0]
    with torch.inference_mode():
        want = quantized_copy(model)(torch.tensor([seq])).logits[0, -4:]
        plain = model(torch.tensor([seq])).logits[0, -4:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-4, "quantizing must change the logits"
    assert weight_bytes(engine.model) < weight_bytes(model)


def test_the_drafts_q_is_the_quantized_models_own_distribution():
    model = tiny_model("llama", seed=1, init_range=0.3)
    engine = tiny_engine(model=copy.deepcopy(model))
    engine.quantize_weights("int8")
    reference = quantized_copy(model)
    params = SamplingParams(temperature=0.7)
    prompt = [3, 14, 15, 92, 6, 53]
    with running_draft(engine) as (_, stub, _loop):
        sid = open_session(stub, prompt, seed=5, temperature=0.7).session_id
        drafts = propose(stub, sid, 4)
    ids = [d.token_id for d in drafts]
    with torch.inference_mode():
        rows = reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : len(prompt) + 3]
        float_rows = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : len(prompt) + 3]
    moved = 0.0
    for d, row, float_row in zip(drafts, rows, float_rows):
        expected = truncate(logits_to_probs(row[None], params)[0], 32)
        assert list(d.q.token_ids) == expected.token_ids.tolist() and d.token_id in d.q.token_ids
        torch.testing.assert_close(torch.tensor(list(d.q.probs)), expected.probs, atol=1e-5, rtol=0)
        assert math.isclose(sum(d.q.probs), 1.0, abs_tol=1e-6)
        moved = max(moved, (logits_to_probs(float_row[None], params)[0]
                            - logits_to_probs(row[None], params)[0]).abs().max().item())
    assert moved > 1e-5, "the float model's q would have passed: the test must tell them apart"


def test_greedy_with_a_quantized_draft_equals_target_alone():
    target = tiny_model(seed=0, init_range=0.3)
    draft_engine = tiny_engine(model=perturbed(target, 0.1, seed=1))
    draft_engine.quantize_weights("int8")
    with running_system(tiny_engine(model=target), draft_engine) as system:
        accepted = 0
        for p in ([5, 9, 17], [30, 31, 2, 8], [100, 3]):
            result = system.client.complete(p, max_tokens=20, temperature=0, num_draft_tokens=3)
            assert len(result.token_ids) > 3 and result.token_ids == greedy_reference(target, p, 20)[: len(result.token_ids)]
            accepted += result.stats.accepted_tokens
        assert accepted > 0, "the quantized draft must be proposing tokens the target accepts"


def test_a_trimmed_head_is_quantized_too_and_only_after_trimming():
    engine = tiny_engine(model=tiny_model(seed=0, init_range=0.3))
    ids = torch.arange(0, TINY_VOCAB, 3)
    engine.restrict_output(ids)
    engine.quantize_weights("int8")
    head = engine.model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and isinstance(head.proj, Int8Linear)
    s = engine.open_session([3, 4, 5])
    logits = engine.extend([ExtendItem(s.id, None, [6, 7], 3)])[0]
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ids]).all()
    with pytest.raises(ValueError, match="before quantizing"):
        engine.restrict_output(ids)


@pytest.mark.slow
def test_sampled_output_with_a_quantized_trimmed_draft_has_the_targets_distribution():
    """The first sampled token over many seeds against the target's own
    distribution (chi-square), the draft quantized and its head trimmed."""
    target = stats_model(0, init_range=0.3)
    prompt = [11, 12, 13]
    params = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        p = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1:], params)[0].double()
    top = torch.argsort(p, descending=True)
    draft_engine = tiny_engine(model=perturbed(target, 0.3, seed=2))
    draft_engine.restrict_output(torch.tensor(sorted(set(range(TINY_VOCAB)) - set(top[1:12:2].tolist()))))
    draft_engine.quantize_weights("int8")
    n = 1200
    with running_system(tiny_engine(model=target), draft_engine) as system:
        results = complete_seeds(system, prompt, range(n), max_tokens=2, temperature=1.0, num_draft_tokens=2)
    firsts = [(r.token_ids or [2])[0] for r in results]  # empty: it ended at EOS (2)
    counts = torch.bincount(torch.tensor(firsts), minlength=TINY_VOCAB).double()
    expected = p * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_the_target_refuses_a_quantized_model():
    from specdec.cli.main import main
    from target_service.server import build_verifier

    with pytest.raises(ValueError, match="draft only"):
        build_verifier(EngineConfig(model="synth:qwen2.5-0.5b", quantize="int8"), SessionLimits())
    engine = tiny_engine()
    engine.quantize_weights("int8")
    with pytest.raises(ValueError, match="draft only"):
        build_verifier(EngineConfig(), SessionLimits(), engine=engine)
    assert main(["serve", "target", "--model", "synth:qwen2.5-0.5b", "--quantize", "int8", "--port", "0"]) == 2


def test_int8_is_cpu_only(capsys):
    from specdec.cli.main import main

    assert main(["serve", "draft", "--device", "cuda", "--quantize", "int8", "--port", "0"]) == 2
    assert "CPU only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(device="cuda", quantize="int8").validate()
    with pytest.raises(ValueError, match="none or int8"):
        EngineConfig(quantize="int4").validate()


def test_auto_quantizes_a_draft_only_where_int8_pays(monkeypatch):
    """`--quantize auto`: int8 for a draft on a CPU with VNNI and fbgemm whose hidden size is at least
    AUTO_MIN_HIDDEN; its dtype elsewhere; an explicit setting as asked."""
    from specdec.engine import quantize

    monkeypatch.setattr(quantize, "_cpu_has_vnni", lambda: True)
    wide = quantize.AUTO_MIN_HIDDEN
    assert quantize.choose("auto", "cpu", wide)[0] == "int8"
    assert quantize.choose("auto", "cpu", 896) == ("int8", "auto: a CPU with VNNI, hidden size 896")
    for device, hidden, why in (("cuda", 896, "runs on cuda"), ("cpu", wide - 1, "below 512"),
                                ("cpu", None, "unknown")):
        kind, reason = quantize.choose("auto", device, hidden)
        assert kind == "none" and why in reason
    assert quantize.choose("none", "cpu", 896)[0] == "none" and quantize.choose("int8", "cpu", 64)[0] == "int8"
    monkeypatch.setattr(quantize, "_cpu_has_vnni", lambda: False)
    assert quantize.choose("auto", "cpu", 896) == ("none", "auto: this CPU has no VNNI, where int8 was not "
                                                           "measured to pay")


def test_auto_loads_a_wide_draft_at_int8_and_never_a_target(monkeypatch, tmp_path):
    """A model of hidden size 512 loaded with quantize=auto: the draft's engine runs it at int8, the
    target's builder at its dtype, and the tests' tiny models (hidden 64) stay as they are."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from draft_service.server import build_drafter
    from draft_service.config import DrafterConfig
    from specdec.engine import quantize
    from specdec.engine.engine import ModelEngine
    from specdec.rpc.model_service import info_to_wire
    from target_service.server import build_verifier

    monkeypatch.setattr(quantize, "_cpu_has_vnni", lambda: True)
    config = Qwen2Config(hidden_size=512, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "wide")
    cfg = EngineConfig(model=str(tmp_path / "wide"), dtype="float32", quantize="auto", max_context=64,
                       max_sessions=2)
    assert is_quantized(ModelEngine.load(cfg).model)
    target = build_verifier(cfg, SessionLimits())
    assert not is_quantized(target.engine.model)
    drafter = build_drafter(cfg, DrafterConfig(), SessionLimits())
    assert is_quantized(drafter.engine.model)
    # ModelInfo says how each runs: the choice depends on the machine, so a caller can read it
    assert info_to_wire(drafter.info, SessionLimits(), "model").weights == "int8"  # what GetModelInfo serves
    assert info_to_wire(target.info, SessionLimits(), "model").weights == ""
    tiny = tiny_model()
    tiny.save_pretrained(tmp_path / "tiny")
    assert not is_quantized(ModelEngine.load(EngineConfig(model=str(tmp_path / "tiny"), quantize="auto")).model)


def test_the_draft_service_defaults_to_auto_and_the_target_to_none(monkeypatch):
    import argparse

    monkeypatch.delenv("SPECD_QUANTIZE", raising=False)  # the environment's value wins over a default
    from specdec.cli.serve_cmd import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve", "draft"]).quantize == "auto"
    assert parser.parse_args(["serve", "target"]).quantize == "none"
