"""A trimmed draft vocabulary: the head over a subset, exact speculative
decoding on top of it (greedy identity, sampled distribution), including
target tokens outside the subset."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine.draft_vocab import SubsetHead, load_ranking, rank_tokens, save_ranking, subset_ids
from specdec.engine.engine import ExtendItem
from tests.conftest import TINY_VOCAB, tiny_engine, tiny_model
from tests.harness import complete_seeds, running_system
from tests.test_orchestrator import greedy_reference, perturbed, stats_model


def test_subset_head_equals_the_full_head_on_its_ids_and_is_minus_inf_elsewhere():
    head = torch.nn.Linear(16, 50, bias=True)
    ids = torch.tensor([0, 3, 7, 49])
    sub = SubsetHead(head, ids, 50)
    h = torch.randn(2, 3, 16)
    full = head(h)
    out = sub(h)
    assert out.shape == full.shape
    torch.testing.assert_close(out[..., ids], full[..., ids])
    others = torch.ones(50, dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(out[..., others]).all()


def test_ranking_subset_and_file(tmp_path):
    ranked = rank_tokens([[5, 5, 5, 2, 2, 9], [9, 9, 9, 1]])
    assert ranked == [9, 5, 2, 1]
    assert subset_ids(ranked, 3, always=[7], vocab_size=10).tolist() == [5, 7, 9]
    assert subset_ids(ranked, 6, always=[], vocab_size=10).tolist() == [0, 1, 2, 3, 5, 9]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        subset_ids(ranked, 11, [], 10)
    save_ranking(tmp_path, ranked, "fp", "test corpus", 10)
    assert load_ranking(tmp_path, "fp") == ranked
    with pytest.raises(ValueError, match="another tokenizer"):
        load_ranking(tmp_path, "other")
    with pytest.raises(FileNotFoundError, match="rank-vocab"):
        load_ranking(tmp_path / "nothing", "fp")


def test_a_restricted_engine_never_emits_outside_its_subset():
    engine = tiny_engine()
    ids = torch.arange(0, TINY_VOCAB, 4)
    engine.restrict_output(ids)
    s = engine.open_session([3, 4, 5])
    logits = engine.extend([ExtendItem(s.id, None, [6, 7], 3)])[0]
    assert set(logits.argmax(-1).tolist()) <= set(ids.tolist())
    assert torch.isneginf(logits[:, 1]).all() and torch.isfinite(logits[:, ids]).all()


def _subset_excluding_targets_choices(target, prompts, n, size):
    """A subset of `size` ids that leaves out some tokens target's greedy
    continuations use, so the target must emit tokens the draft cannot."""
    used = {t for p in prompts for t in greedy_reference(target, p, n)} - {2}  # keep EOS
    excluded = sorted(used)[::2]
    keep = [i for i in range(TINY_VOCAB) if i not in excluded][:size]
    return torch.tensor(keep), set(excluded)


def test_greedy_with_a_trimmed_draft_equals_target_alone_even_outside_the_subset():
    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.1, seed=1)
    prompts = [[5, 9, 17], [30, 31, 2, 8], [100, 3]]
    ids, excluded = _subset_excluding_targets_choices(target, prompts, 20, 48)
    draft_engine = tiny_engine(model=draft)
    draft_engine.restrict_output(ids)
    with running_system(tiny_engine(model=target), draft_engine) as system:
        emitted_outside = 0
        for p in prompts:
            result = system.client.complete(p, max_tokens=20, temperature=0, num_draft_tokens=3)
            ref = greedy_reference(target, p, 20)
            assert len(result.token_ids) > 3 and result.token_ids == ref[: len(result.token_ids)]
            emitted_outside += sum(t in excluded for t in result.token_ids)
        assert emitted_outside > 0, "the test must make the target emit tokens outside the draft's subset"


@pytest.mark.slow
def test_sampled_output_with_a_trimmed_draft_has_the_targets_distribution():
    """The first sampled token after a fixed prompt, over many seeds, against
    the target's own distribution (chi-square), with a draft whose subset
    leaves out tokens that carry target probability."""
    from specdec.sampling.params import SamplingParams
    from specdec.sampling.transform import logits_to_probs

    target = stats_model(0, init_range=0.3)
    draft = perturbed(target, 0.3, seed=2)
    prompt = [11, 12, 13]
    params = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        p = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1:], params)[0].double()
    top = torch.argsort(p, descending=True)
    ids = torch.tensor(sorted(set(range(TINY_VOCAB)) - set(top[1:12:2].tolist())))  # drop 6 likely tokens
    draft_engine = tiny_engine(model=draft)
    draft_engine.restrict_output(ids)
    n = 1200
    with running_system(tiny_engine(model=target), draft_engine) as system:
        results = complete_seeds(system, prompt, range(n), max_tokens=2, temperature=1.0, num_draft_tokens=2)
    firsts = [(r.token_ids or [2])[0] for r in results]  # empty: it ended at EOS (2)
    counts = torch.bincount(torch.tensor(firsts), minlength=TINY_VOCAB).double()
    outside = sum(counts[i].item() for i in top[1:12:2].tolist())
    assert outside > 0, "tokens outside the subset must still be emitted (as recoveries)"
    expected = p * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_rank_vocab_command_and_draft_vocab_flag(tmp_path):
    """`specd models rank-vocab DIR` writes the ranking beside the model, and
    --draft-vocab N loads the engine with a head over the N most frequent ids."""
    import argparse

    from specdec.cli import rank_vocab_cmd
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine
    from specdec.errors import InvalidArgument
    from tests.test_padded_vocab import saved_model, trained_tokenizer

    tok = trained_tokenizer()
    directory = tmp_path / "draft"
    saved_model(directory, tok, rows=320, seed=0)
    with pytest.raises(InvalidArgument, match="rank-vocab"):
        ModelEngine.load(EngineConfig(model=str(directory), dtype="float32", draft_vocab=64, max_kv_bytes=1 << 26))
    args = argparse.Namespace(model=str(directory), generate_with="", generated_tokens=0, max_files=20)
    assert rank_vocab_cmd.run_rank_vocab(args) == 0
    from transformers import AutoTokenizer

    from specdec.engine.loading import tokenizer_fingerprint
    ranked = load_ranking(directory, tokenizer_fingerprint(AutoTokenizer.from_pretrained(directory), 0))
    assert len(ranked) > 64
    engine = ModelEngine.load(EngineConfig(model=str(directory), dtype="float32", draft_vocab=64, max_kv_bytes=1 << 26))
    assert engine.output_ids == 64
    s = engine.open_session([ranked[0], ranked[1]])
    logits = engine.extend([ExtendItem(s.id, None, [ranked[2]], 2)])[0]
    assert int(torch.isfinite(logits[0]).sum()) == 64
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) <= set(ranked[:64]) | set(engine.info.eos_token_ids)
