"""Checks on the real default pair; they run only where it is cached
(`specd models fetch`), and on a GPU only where CUDA is present."""
from __future__ import annotations

import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.engine.engine import ExtendItem, ModelEngine
from specdec.models.catalog import DEFAULT_PAIR


def _cached(name: str) -> bool:
    from specdec.models.cache import resolve_model

    try:
        resolve_model(name)
        return True
    except LookupError:
        return False


needs_pair = pytest.mark.skipif(not (_cached(DEFAULT_PAIR.draft) and _cached(DEFAULT_PAIR.target)),
                                reason="the default pair is not cached (specd models fetch)")


@pytest.mark.real_models
@needs_pair
def test_real_pair_loads_batches_and_rolls_back():
    draft = ModelEngine.load(EngineConfig(model=DEFAULT_PAIR.draft, dtype="float32", threads=2))
    target = ModelEngine.load(EngineConfig(model=DEFAULT_PAIR.target, dtype="float32", threads=2))
    assert draft.vocab_size == target.vocab_size == 151936
    assert draft.info.tokenizer_fingerprint == target.info.tokenizer_fingerprint
    prompt = target.tokenizer("def fibonacci(n):", add_special_tokens=True)["input_ids"]
    a = target.open_session(prompt)
    b = target.open_session(prompt[:3])
    first = target.extend([ExtendItem(a.id, None, [], 1)])[0]
    target.rollback(a.id, len(prompt) - 1)
    batched = target.extend([ExtendItem(a.id, None, prompt[-1:], 1), ExtendItem(b.id, None, prompt[3:], 1)])
    torch.testing.assert_close(batched[0], first, atol=1e-3, rtol=0)
    torch.testing.assert_close(batched[1], first, atol=1e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_gpu_matches_cpu_bf16():
    from tests.conftest import tiny_model

    cpu_model = tiny_model(seed=0)
    gpu_engine = ModelEngine(tiny_model(seed=0).to("cuda"), EngineConfig(device="cuda", dtype="float32"))
    tokens = list(range(3, 40))
    s = gpu_engine.open_session(tokens[:10])
    logits = gpu_engine.extend([ExtendItem(s.id, None, tokens[10:], len(tokens) - 9)])[0].cpu()
    with torch.inference_mode():
        ref = cpu_model(torch.tensor([tokens])).logits[0, 9:]
    torch.testing.assert_close(logits, ref, atol=1e-3, rtol=0)


@pytest.mark.real_models
@needs_pair
@pytest.mark.parametrize("name,quantize", [(DEFAULT_PAIR.draft, "none"), (DEFAULT_PAIR.draft, "int8"),
                                           (DEFAULT_PAIR.target, "none")])
def test_fused_layers_give_the_real_models_logits_bit_for_bit(name, quantize):
    """bf16 with packed linears (the CPU default) and the int8 draft: the
    fused decoder's logits equal transformers' exactly on the CPU."""
    outs = []
    for fused in ("off", "on"):
        engine = ModelEngine.load(EngineConfig(model=name, fused_layers=fused, quantize=quantize, max_context=256,
                                               max_sessions=4, threads=2))
        assert (engine.fused is not None) == (fused == "on")
        seqs = [torch.randint(3, 150000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 70)]
        sessions = [engine.open_session(seq) for seq in seqs]
        out = engine.extend([ExtendItem(s.id, None, [7, 8, 9, 10], 5) for s in sessions])
        out += engine.extend([ExtendItem(s.id, None, [11], 1) for s in sessions])
        outs.append(out)
        del engine
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
