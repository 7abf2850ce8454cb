"""Synthetic models: random weights in real architectures (specdec.models.synth).
Only the tiny one is built; the Qwen2.5 ones are counted on the meta device."""
from __future__ import annotations

import json

import pytest
import torch

from orchestrator.tokenizer import load_tokenizer
from specdec.cli.main import main
from specdec.engine.config import EngineConfig
from specdec.engine.engine import ExtendItem, ModelEngine
from specdec.engine.vocab import IdSpace
from specdec.errors import NotFound
from specdec.models import synth
from specdec.models.cache import Manifest, write_manifest
from tests.test_padded_vocab import trained_tokenizer


def tiny_logits(engine: ModelEngine) -> torch.Tensor:
    session = engine.open_session([1, 2, 3, 4])
    try:
        return engine.extend([ExtendItem(session.id, None, [5], num_logits=2)])[0]
    finally:
        engine.close(session.id)


def test_the_table_holds_the_real_configs():
    spec = synth.get_synth("synth:qwen2.5-7b")
    config = spec.config()
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (3584, 18944, 28)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (28, 4, 152064)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 32768 and not config.use_sliding_window
    assert synth.get_synth("qwen2.5-0.5b").tied_embeddings and not spec.tied_embeddings
    assert synth.synth_names()[:5] == ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"]


def test_the_half_billion_model_counts_its_parameters_on_the_meta_device():
    # Qwen2.5-0.5B: 494,032,768 parameters, the embedding counted once (tied).
    assert synth.parameter_count("qwen2.5-0.5b") == 494_032_768


def test_an_unknown_name_is_refused_clearly():
    with pytest.raises(LookupError, match="unknown synthetic model 'qwen9'; known: qwen2.5-0.5b"):
        synth.get_synth("synth:qwen9")
    with pytest.raises(NotFound, match="unknown synthetic model"):
        ModelEngine.load(EngineConfig(model="synth:qwen9"))


def test_serving_synth_tiny_builds_it_in_memory():
    state = torch.random.get_rng_state()
    engine = ModelEngine.load(EngineConfig(model="synth:tiny", dtype="float32", max_kv_bytes=1 << 26))
    assert torch.equal(torch.random.get_rng_state(), state), "the build must not reseed the caller's generator"
    assert engine.info.model_name == "synth:tiny" and engine.vocab_size == engine.usable_vocab_size == 512
    assert engine.info.tokenizer_fingerprint.startswith("untokenized") and engine.tokenizer is None
    logits = tiny_logits(engine)
    assert logits.shape == (2, 512) and torch.isfinite(logits).all()
    again = ModelEngine.load(EngineConfig(model="synth:tiny", dtype="float32", max_kv_bytes=1 << 26))
    assert torch.equal(tiny_logits(again), logits), "one name, one model"
    bf16 = ModelEngine.load(EngineConfig(model="synth:tiny", dtype="bfloat16", max_kv_bytes=1 << 26))
    assert bf16.info.dtype == "bfloat16"


def test_models_synth_saves_a_loadable_model(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["models", "synth", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    marker = json.loads((out / synth.MARKER_NAME).read_text())
    assert marker["synthetic"] == "tiny" and marker["parameters"] == synth.parameter_count("tiny")
    saved = ModelEngine.load(EngineConfig(model=str(out), dtype="float32", max_kv_bytes=1 << 26))
    built = ModelEngine.load(EngineConfig(model="synth:tiny", dtype="float32", max_kv_bytes=1 << 26))
    assert torch.equal(tiny_logits(saved), tiny_logits(built))
    # No tokenizer files, so no tokenizer (not the one-token one transformers makes up for a Qwen2).
    assert saved.tokenizer is None and saved.usable_vocab_size == 512
    # Writing over a directory that holds something is refused.
    assert main(["models", "synth", "tiny", "--out", str(out)]) == 1
    assert "not an empty directory" in capsys.readouterr().err


def test_models_synth_with_an_unknown_name_exits_2_with_one_line(tmp_path, capsys):
    assert main(["models", "synth", "qwen9", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown synthetic model 'qwen9'" in err
    assert not (tmp_path / "x").exists()


def test_a_qwen_family_model_takes_the_tokenizer_of_a_cached_catalog_model(tmp_path):
    cache = tmp_path / "cache"
    assert synth.tokenizer_dir("qwen2.5-7b", cache) is None
    donor = cache / synth.TOKENIZER_DONORS["qwen2.5"][1]
    donor.mkdir(parents=True)
    (donor / "config.json").write_text("{}")
    (donor / "model.safetensors").write_bytes(b"")
    trained_tokenizer().save_pretrained(donor)
    write_manifest(donor, Manifest("donor", "0" * 64, 0, "float32", "now", "5", "2"))
    assert synth.tokenizer_dir("qwen2.5-7b", cache) == donor
    assert synth.tokenizer_dir("tiny", cache) is None  # a tiny one has none
    assert len(synth.load_tokenizer("synth:qwen2.5-0.5b", cache)) == len(trained_tokenizer())


def test_without_a_tokenizer_a_qwen_family_model_names_its_familys_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))  # an empty cache: no donor tokenizer
    assert synth.load_tokenizer("synth:qwen2.5-7b") is None
    assert synth.id_space("qwen2.5-7b") == synth.id_space("qwen2.5-0.5b") == IdSpace("qwen2.5", 151665)
    assert synth.id_space("tiny") is None  # of no family: its rows are its ids


def test_a_synthetic_engine_without_a_tokenizer_announces_and_masks_its_familys_ids(tmp_path, monkeypatch):
    """Loading wires the family's ids through to the engine (the path the first GPU bench needed):
    the tiny synth (512 rows) as if its family had 300 tokens."""
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(synth, "id_space", lambda name: IdSpace("fam", 300))
    engine = ModelEngine.load(EngineConfig(model="synth:tiny", dtype="float32", max_kv_bytes=1 << 24))
    assert engine.tokenizer is None and engine.vocab_size == 512
    assert engine.info.tokenizer_fingerprint == "untokenized-fam-300" and engine.info.usable_vocab_size == 300
    session = engine.open_session([5, 6, 7])
    logits = engine.extend([ExtendItem(session.id, None, [8], num_logits=1)])[0]
    assert torch.isneginf(logits[0, 300:]).all() and torch.isfinite(logits[0, :300]).all()


def test_the_orchestrator_reads_a_synth_targets_tokenizer_from_the_synth_module(monkeypatch, tmp_path):
    """Its donor's directory read without torch (orchestrator/tokenizer.py) when
    it has tokenizer.json; the synth module's own loader otherwise."""
    monkeypatch.setattr(synth, "load_tokenizer", lambda name, cache_dir=None: ("tokenizer of", name))
    monkeypatch.setattr(synth, "tokenizer_dir", lambda name, cache_dir=None: None)
    assert load_tokenizer("synth:qwen2.5-7b") == ("tokenizer of", "synth:qwen2.5-7b")
    trained_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(synth, "tokenizer_dir", lambda name, cache_dir=None: tmp_path)
    assert len(load_tokenizer("synth:qwen2.5-7b")) == len(trained_tokenizer())


def test_a_trimmed_head_on_a_synthetic_model_keeps_the_lowest_ids_for_step_costs():
    """No frequencies to rank on random weights: --draft-vocab still measures a head of that size."""
    engine = ModelEngine.load(EngineConfig(model="synth:tiny", dtype="float32", max_kv_bytes=1 << 24, draft_vocab=100))
    assert engine.output_ids == 100
    session = engine.open_session([5, 6, 7])
    logits = engine.extend([ExtendItem(session.id, None, [8], num_logits=1)])[0]
    finite = torch.isfinite(logits[0]).nonzero()[:, 0].tolist()
    assert len(finite) == 100 and set(finite) - set(range(100)) <= set(engine.info.eos_token_ids)
