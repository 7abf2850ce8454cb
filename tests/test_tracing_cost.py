"""`specd overhead --end-to-end`: tokens/s through whole systems with tracing
on and off, and spans per generated token (specdec/bench/tracing_cost.py)."""
from __future__ import annotations

import re

from specdec.cli.main import main


def test_specd_overhead_end_to_end_counts_spans_of_the_traced_system_only(tmp_path, capsys):
    from specdec.bench.tiny_pair import ensure_tiny_pair

    draft, target = ensure_tiny_pair(tmp_path)
    rc = main(["--log-level", "ERROR", "overhead", "--end-to-end", "--target", str(target), "--draft", str(draft),
               "--dtype", "float32", "--threads", "1", "--requests", "2", "--tokens", "8", "--num-draft-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy, k=3, 2 requests x 8 tokens per mode" in out
    rates = dict(re.findall(r"^\| (on|off) \(.*?\) \| ([\d.]+) \|", out, re.M))
    assert set(rates) == {"on", "off"} and all(float(v) > 0 for v in rates.values())
    # Only the traced system's requests leave spans: its warm-up and 2 requests,
    # none of the 3 the untraced system served.
    spans, requests, per_token = re.search(r"spans: (\d+) for (\d+) requests .*?, ([\d.]+) per generated token",
                                           out).groups()
    assert int(requests) == 3 and int(spans) > 3 and float(per_token) > 0
    assert abs(float(per_token) - int(spans) / (8 + 2 * 8)) < 0.01  # no EOS: every request runs to its tokens
    assert re.search(r"one span .*: [\d.]+ µs traced, \d+ ns with tracing off", out)


def test_specd_overhead_end_to_end_wants_both_models_or_neither(capsys):
    assert main(["overhead", "--end-to-end", "--draft", "qwen2.5-coder-0.5b-instruct"]) == 1
    assert "both --draft and --target" in capsys.readouterr().err


def test_the_random_pair_is_the_tests_tiny_random_pair():
    """--random-pair reproduces the former script's pair: the tests' tiny target
    (init_range 0.3) and its perturbed copy, neither with an EOS."""
    import torch

    from specdec.bench.tracing_cost import random_pair
    from tests.conftest import tiny_model
    from tests.test_orchestrator import perturbed

    target, draft, tokenizer, prompts = random_pair()
    want_target = tiny_model(seed=0, init_range=0.3)
    want_draft = perturbed(want_target, 0.15, seed=1)
    ids = torch.tensor([prompts[1]])
    for engine, want in ((target, want_target), (draft, want_draft)):
        with torch.inference_mode():  # the same model: the same logits (its layers may run fused)
            assert torch.equal(engine.model(ids).logits, want(ids).logits)
        assert engine.info.eos_token_ids == ()
    assert tokenizer is None and len(prompts) == 64 and prompts[1] == [3 + (7 + j * j) % 120 for j in range(9)]
