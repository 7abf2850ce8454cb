"""specdec.bench.tiny_pair: the tiny random draft/target pair for network sweeps.
Everything is built under pytest's tmp_path; the user's cache is never touched."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specdec.bench import tiny_pair
from specdec.bench.tiny_pair import (
    VOCAB_SIZE,
    ensure_tiny_pair,
    greedy_agreement,
    tiny_prompts,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(cache_dir, draft_dir, target_dir), built once for the module."""
    cache = tmp_path_factory.mktemp("cache")
    draft_dir, target_dir = ensure_tiny_pair(cache)
    return cache, draft_dir, target_dir


@pytest.fixture(scope="module")
def models(pair):
    _cache, draft_dir, target_dir = pair
    return tuple(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (draft_dir, target_dir))


def _files(directory):
    return {p.relative_to(directory): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_layout(pair):
    cache, draft_dir, target_dir = pair
    root = cache / "tiny-pair" / tiny_pair.VERSION
    assert (draft_dir, target_dir) == (root / "draft", root / "target")
    for d in (draft_dir, target_dir):
        assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
        assert not list(d.glob("tokenizer*"))
    assert json.loads((root / "tiny-pair.json").read_text())["version"] == tiny_pair.VERSION
    assert [p.name for p in (cache / "tiny-pair").iterdir()] == [tiny_pair.VERSION]  # no build leftovers


def test_second_call_reuses_the_build(pair, monkeypatch):
    cache, draft_dir, target_dir = pair
    before = _files(cache)

    def no_rebuild():
        raise AssertionError("the pair was rebuilt")

    monkeypatch.setattr(tiny_pair, "build_models", no_rebuild)
    assert ensure_tiny_pair(cache) == (draft_dir, target_dir)
    assert ensure_tiny_pair(str(cache)) == (draft_dir, target_dir)
    assert _files(cache) == before


def test_default_cache_dir_comes_from_the_environment(pair, monkeypatch):
    cache, draft_dir, target_dir = pair
    monkeypatch.setenv("SPECD_CACHE_DIR", str(cache))
    monkeypatch.setattr(tiny_pair, "build_models", lambda: pytest.fail("rebuilt"))
    assert ensure_tiny_pair() == (draft_dir, target_dir)


def test_builds_are_deterministic(pair, tmp_path):
    _cache, draft_dir, target_dir = pair
    torch.manual_seed(12345)  # the caller's RNG state must not matter ...
    state = torch.get_rng_state()
    other_draft, other_target = ensure_tiny_pair(tmp_path)
    assert torch.equal(torch.get_rng_state(), state)  # ... and is left as it was
    for a, b in ((draft_dir, other_draft), (target_dir, other_target)):
        wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_an_incomplete_build_is_replaced(tmp_path):
    root = tmp_path / "tiny-pair" / tiny_pair.VERSION
    (root / "target").mkdir(parents=True)
    (root / "target" / "config.json").write_text("{}")  # what an interrupted build might leave
    _draft_dir, target_dir = ensure_tiny_pair(tmp_path)
    assert (root / "tiny-pair.json").is_file()
    assert json.loads((target_dir / "config.json").read_text())["vocab_size"] == VOCAB_SIZE


def test_shapes_share_the_vocabulary_and_the_draft_is_smaller(models):
    draft, target = models
    assert draft.config.vocab_size == target.config.vocab_size == VOCAB_SIZE
    assert draft.get_input_embeddings().weight.shape == target.get_input_embeddings().weight.shape
    assert draft.get_output_embeddings().weight.shape == target.get_output_embeddings().weight.shape
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    n_draft = sum(p.numel() for p in draft.parameters())
    n_target = sum(p.numel() for p in target.parameters())
    assert n_draft * 3 < n_target
    # the draft is the target's first layer with the same embedding, norm and head
    dstate, tstate = draft.state_dict(), target.state_dict()
    assert all(torch.equal(dstate[k], tstate[k]) for k in dstate)


def test_tiny_prompts():
    prompts = tiny_prompts(8)
    assert prompts == tiny_prompts(8) and prompts[:3] == tiny_prompts(3)
    assert prompts != tiny_prompts(8, seed=1)
    assert len({tuple(p) for p in prompts}) == 8
    assert all(len(p) == 24 and all(3 <= t < VOCAB_SIZE for t in p) for p in prompts)
    assert [len(p) for p in tiny_prompts(2, length=5)] == [5, 5]


def test_greedy_agreement_is_in_a_sane_band(models):
    """Catches a broken build (agreement ~0 or ~1), not a timing: measured 0.73."""
    draft, target = models
    agreement = greedy_agreement(draft, target, tiny_prompts(16), new_tokens=32)
    assert 0.4 <= agreement <= 0.95, agreement
    assert greedy_agreement(target, target, tiny_prompts(2), new_tokens=8) == 1.0


def test_services_generate_with_the_pair(pair):
    """The engine loads the directories (no tokenizer: an 'untokenized'
    fingerprint, no EOS), and a draft + target + orchestrator answer a
    Generate with prompt_token_ids; greedy output equals target-only decoding."""
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine
    from tests.harness import running_system

    _cache, draft_dir, target_dir = pair
    engines = [ModelEngine.load(EngineConfig(model=str(d), dtype="float32", max_kv_bytes=1 << 27))
               for d in (draft_dir, target_dir)]
    draft, target = engines
    for engine in engines:
        assert engine.info.tokenizer_fingerprint.startswith("untokenized")
        assert engine.info.eos_token_ids == ()
        assert engine.info.vocab_size == VOCAB_SIZE
    prompt = tiny_prompts(1)[0]
    with running_system(target, draft) as system:  # start-up checks the two fit together
        speculative = system.client.complete(prompt, max_tokens=24, temperature=0.0)
        plain = system.client.complete(prompt, max_tokens=24, temperature=0.0, speculate=False)
    assert len(speculative.token_ids) == 24  # no EOS: runs to max_tokens
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.accepted_tokens > 0
