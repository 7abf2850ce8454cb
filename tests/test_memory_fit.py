"""`specd bench`'s memory check (bench/memory_fit.py): each copy counted as it
is held (its own device's dtype, one draft per head, a trimmed head, int8
linears), against what a loaded model really holds, and the refusals that
follow from it. Free memory is faked; nothing large is built (meta device)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from specdec.bench import memory_fit
from specdec.engine.draft_vocab import restrict_head
from specdec.engine.quantize import quantize_linears
from tests.test_bench import _bench_args

GIB = 2**30


def _held_bytes(model) -> int:
    """What a loaded model holds for its weights: each parameter once (a tied
    one too) and the int8 weights and scales of its quantized linears."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total + sum(m.weight_nbytes for m in model.modules() if hasattr(m, "weight_nbytes"))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("head", [0, 40])
@pytest.mark.parametrize("int8", [False, True])
def test_a_copy_is_counted_as_the_loaded_model_holds_it(tied, head, int8):
    """A trimmed head replaces an untied full head but comes on top of a tied
    one (the embedding stays); int8 keeps the embedding, norms and biases at
    full width and gives a tied head an int8 copy of its own."""
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if head:
        restrict_head(model, torch.arange(head))
    if int8:
        with torch.no_grad():
            quantize_linears(model)
    shape = memory_fit.config_shape(config)
    assert shape.tied == tied
    assert memory_fit.copy_bytes(shape, 4, head, int8) == _held_bytes(model)


def _free(cpu_gib: float, cuda_gib: float = 64.0):
    return lambda device: int((cpu_gib if torch.device(device).type == "cpu" else cuda_gib) * GIB)


def test_each_model_is_counted_in_the_dtype_of_its_own_device(monkeypatch):
    """--dtype auto beside a CUDA target (bf16 there) loads a CPU draft in fp32 on a CPU without native bf16:
    the 0.5B's 1.8 GiB, not the 0.9 GiB it would be at the target's bf16."""
    from specdec.cli.bench_options import UsageError, resolve
    from specdec.engine import loading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(loading, "free_device_memory", _free(cpu_gib=1.5))
    split = dict(pair="synth-0.5b-7b", draft_device="cpu", target_device="cuda", dtype="auto")
    with pytest.raises(UsageError, match=r"need 1\.8 GiB on cpu \(draft \(service\) 1\.8\) and 1\.5 GiB is free"):
        resolve(_bench_args(**split))
    assert resolve(_bench_args(**dict(split, dtype="bfloat16")))["draft_device"] == "cpu"  # 0.9 GiB fits


def test_every_draft_head_is_a_service_of_its_own(monkeypatch):
    """--draft-vocab 0 32768 runs two draft services at once: the full 0.5B and one whose trimmed head's
    32768 rows come on top of the tied embedding (0.98 GiB)."""
    from specdec.cli.bench_options import UsageError, resolve
    from specdec.engine import loading

    monkeypatch.setattr(loading, "free_device_memory", _free(cpu_gib=4.5))
    heads = dict(pair="synth-0.5b-1.5b", dtype="bfloat16", draft_vocab=[0, 32768])
    with pytest.raises(UsageError, match=r"need 4\.8 GiB on cpu \(target \(service\) 2\.9, draft full head \(service\) "
                                         r"0\.9, draft head 32768 \(service\) 1\.0\)"):
        resolve(_bench_args(**heads))
    assert resolve(_bench_args(**dict(heads, draft_vocab=[0])))["draft_vocabs"] == [0]  # one draft: 3.8 GiB fits


def test_an_int8_draft_is_counted_at_int8(monkeypatch):
    """--draft-quantize int8: the 0.5B's linears at a byte (and a scale a row), its embedding at bf16 beside
    the int8 copy of its tied head: 0.7 GiB in the service and again in the HF assisted baseline, not 0.9."""
    from specdec.cli.bench_options import UsageError, resolve
    from specdec.engine import loading

    int8 = dict(pair="synth-0.5b-1.5b", dtype="bfloat16", draft_quantize="int8")
    monkeypatch.setattr(loading, "free_device_memory", _free(cpu_gib=3.7))
    assert resolve(_bench_args(**int8))["draft_dir"] == "synth:qwen2.5-0.5b"  # 3.6 GiB; at bf16 3.8 would not fit
    with pytest.raises(UsageError, match=r"\(target \(service\) 2\.9, target \(HF baselines\) 2\.9, "
                                         r"draft \(service\) 0\.7, draft \(HF baselines\) 0\.7\)"):
        resolve(_bench_args(**dict(int8, baselines=["service", "hf-assisted"])))
