"""`specd identity`: greedy speculative vs target-only in one process, and the
diagnosis of the first difference (specdec/bench/identity.py)."""
from __future__ import annotations

import torch

from specdec.bench.identity import describe, diagnose, first_difference, speculative, target_only
from specdec.cli.main import main
from tests.conftest import tiny_engine, tiny_model
from tests.test_orchestrator import GREEDY_PROMPTS, perturbed


def test_fp32_speculative_greedy_is_identical_to_target_only(one_thread):
    target_model = tiny_model(seed=0, init_range=0.3)
    target = tiny_engine(model=target_model)
    draft = tiny_engine(model=perturbed(target_model, 0.15, seed=1))
    ref, ref_rows = target_only(target, GREEDY_PROMPTS[3], 20)
    spec, spec_rows = speculative(target, draft, GREEDY_PROMPTS[3], 20, 3)
    assert ref == spec and len(ref) == 20 and len(ref_rows) == len(spec_rows) == 20
    assert all(r.shape == (target.vocab_size,) for r in spec_rows)
    # The same position's logits from a 1-token and a 4-token forward agree to fp32 rounding.
    assert max(float((a - b).abs().max()) for a, b in zip(ref_rows, spec_rows)) < 1e-3
    results = list(diagnose(target, draft, GREEDY_PROMPTS[:2], 8, 4))
    assert [r.index for r in results] == [0, 1] and all(r.identical and r.tokens == 8 for r in results)
    assert describe(results[0]) == "prompt 0: identical (8 tokens)"
    assert target.num_sessions == draft.num_sessions == 0


def test_the_first_difference_reports_both_paths_top2_and_their_difference():
    ref_rows = [torch.tensor([0.0, 5.0, 1.0]), torch.tensor([3.0, 2.875, 0.0])]
    tie_rows = [torch.tensor([0.0, 5.0, 1.0]), torch.tensor([2.9375, 3.0, 0.0])]
    d = first_difference([1, 0], ref_rows, [1, 1], tie_rows)
    assert (d.position, d.target_only_token, d.speculative_token) == (1, 0, 1)
    assert d.target_only_top2.ids == [0, 1] and d.speculative_top2.ids == [1, 0]
    assert abs(d.target_only_top2.gap - 0.125) < 1e-6 and abs(d.speculative_top2.gap - 0.0625) < 1e-6
    assert abs(d.max_abs_difference - 0.125) < 1e-6
    from specdec.bench.identity import PromptResult

    text = describe(PromptResult(4, 2, d))
    assert text.startswith("prompt 4: first difference at generated token 1: target-only chose 0, speculative chose 1")
    assert "top-2 ids [1, 0] values [3.0, 2.9375] (gap 0.0625)" in text and "position: 0.1250" in text
    assert first_difference([1, 0], ref_rows, [1, 0], ref_rows) is None


def test_specd_identity_on_the_tiny_pair_in_fp32(tmp_path, capsys):
    from specdec.bench.tiny_pair import ensure_tiny_pair

    draft, target = ensure_tiny_pair(tmp_path)
    rc = main(["--log-level", "ERROR", "identity", "--target", str(target), "--draft", str(draft), "--dtype", "float32",
               "--first-prompt", "1", "--prompts", "2", "--max-tokens", "16", "--num-draft-tokens", "3",
               "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "prompt 1: identical (16 tokens)" in out and "prompt 2: identical (16 tokens)" in out
    assert "prompt 0" not in out and "identical: 2/2 (float32, k=3)" in out


def test_specd_identity_refuses_an_unknown_model(capsys):
    assert main(["identity", "--target", "no-such-model", "--prompts", "1"]) == 1
    assert "no-such-model" in capsys.readouterr().err
