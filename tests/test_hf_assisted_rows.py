"""specdec/bench/hf_baselines.py: HF assisted generation for a pair whose
vocabulary rows differ (Qwen2.5 0.5B + 7B: 151,936 and 152,064). The draft
gets the target's rows and proposes what it proposed before; the output is
the target's own, greedy; sampled, it runs."""
from __future__ import annotations

import pytest
import torch

from specdec.engine.config import EngineConfig
from tests.conftest import TINY_VOCAB, tiny_model


def _save(tmp_path, draft_rows: int):
    tiny_model("qwen2", seed=3, init_range=0.2, vocab_size=TINY_VOCAB).save_pretrained(tmp_path / "target")
    tiny_model("qwen2", seed=4, init_range=0.2, layers=1, vocab_size=draft_rows).save_pretrained(tmp_path / "draft")
    return [EngineConfig(model=str(tmp_path / role), dtype="float32") for role in ("target", "draft")]


@pytest.mark.parametrize("draft_rows", [TINY_VOCAB - 32, TINY_VOCAB + 16], ids=["fewer rows", "more rows"])
def test_assisted_generation_runs_for_a_draft_with_other_rows_and_keeps_the_targets_output(tmp_path, draft_rows):
    from specdec.bench.hf_baselines import HFBaselines

    hf = HFBaselines(*_save(tmp_path, draft_rows))
    assert hf.draft_rows == (draft_rows, TINY_VOCAB)
    prompt = [5, 9, 17, 30]
    plain = hf.generate(prompt, max_tokens=12, temperature=0, seed=0, kind="hf")["token_ids"]
    assisted = hf.generate(prompt, max_tokens=12, temperature=0, seed=0, kind="hf-assisted")["token_ids"]
    assert assisted == plain and len(plain) > 0
    sampled = hf.generate(prompt, max_tokens=12, temperature=0.8, seed=1, kind="hf-assisted")["token_ids"]
    assert all(0 <= t < TINY_VOCAB for t in sampled)


def test_a_draft_with_fewer_rows_gives_the_same_distribution_over_them_and_none_past_them():
    from specdec.bench.hf_baselines import match_rows

    draft = tiny_model("qwen2", seed=4, init_range=0.2, layers=1, vocab_size=TINY_VOCAB - 32)
    ids = torch.tensor([[5, 9, 17, 30]])
    with torch.no_grad():
        before = draft(ids).logits
        match_rows(draft, TINY_VOCAB)
        after = draft(ids).logits
        # An id only the target has (one of its padding rows) can be read.
        draft(torch.tensor([[5, TINY_VOCAB - 1]]))
    assert after.shape[-1] == TINY_VOCAB and draft.config.vocab_size == TINY_VOCAB
    assert torch.equal(after[..., : TINY_VOCAB - 32], before)
    assert torch.all(after[..., TINY_VOCAB - 32:] == float("-inf"))
    assert torch.equal(torch.softmax(after, -1)[..., : TINY_VOCAB - 32], torch.softmax(before, -1))
