"""A round's drafting ends once the draft is unsure (`min_confidence`).

Each draft carries the draft's confidence in it (its probability of the
token: the model's softmax at the argmax when greedy, q(x) when sampling);
a Propose with `min_confidence` stops after the draft at which the product
of the confidences so far falls below it. The
drafts it does make are the ones it would have made anyway, the orchestrator
verifies however many come back, and the output stays exact: greedy tokens
equal target-only decoding, sampled outputs are distributed as the target."""
from __future__ import annotations

import grpc
import pytest
import torch

from draft_service.drafters import ModelDrafter
from draft_service.ngram_drafter import NgramDrafter
from specdec.errors import InvalidArgument
from specdec.rpc.model_service import SessionMeta
from specdec.sampling.draft_picks import DraftRow, pick_drafts
from specdec.sampling.params import SamplingParams
from specdec.v1 import draft_pb2
from tests.conftest import tiny_engine, tiny_model
from tests.harness import complete_seeds, running_draft, running_system
from tests.test_orchestrator import (PROMPT, SAMPLES, VOCAB, assert_matches, exact_two_token_distribution,
                                     greedy_reference, perturbed, stats_model)
from tests.test_services import T, open_session

GREEDY = SessionMeta(params=SamplingParams(0.0, 0, 1.0), seed=1)
SAMPLED = SessionMeta(params=SamplingParams(0.9, 0, 1.0), seed=7)
PROMPTS = [[5 + (3 * i + j) % 100 for j in range(4 + 3 * i)] for i in range(8)]


def test_each_pick_carries_the_drafts_probability_of_its_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    logits[3, 40:] = float("-inf")  # a masked tail changes nothing
    rows = [DraftRow(SamplingParams(0.0, 0, 1.0), 1, 5), DraftRow(SamplingParams(0.7, 0, 1.0), 2, 6),
            DraftRow(SamplingParams(0.0, 0, 1.0), 3, 7), DraftRow(SamplingParams(1.0, 5, 1.0), 4, 8)]
    picks = pick_drafts(logits, rows, max_q_tokens=50)
    for row, r, pick in zip(logits, rows, picks):
        if r.params.greedy:
            assert pick.confidence == pytest.approx(float(row.softmax(-1).max()), rel=1e-5)
        else:
            assert pick.confidence == pytest.approx(pick.q.prob(pick.token_id), rel=1e-6)
        assert 0 < pick.confidence <= 1


def _products(drafts) -> list[float]:
    out, belief = [], 1.0
    for d in drafts:
        belief *= d.confidence
        out.append(belief)
    return out


def _stop_case(drafter, meta):
    """A prompt, its 8 unstopped drafts, and a threshold that the product of
    the confidences first falls below at draft j (1 <= j <= 6)."""
    for prompt in PROMPTS:
        sid, _, _ = drafter.open(prompt, meta, 32)
        full = list(drafter.propose(sid, None, [], 8))
        drafter.close(sid)
        products = _products(full)
        for j in range(2, 7):
            if products[j] < 0.95 * products[j - 1]:  # a clear step down, far from rounding
                return prompt, full, (products[j] + products[j - 1]) / 2, j
    raise AssertionError("no prompt whose drafts' confidences fall after the first two")


@pytest.mark.parametrize("meta", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_propose_ends_after_the_first_draft_below_min_confidence(meta):
    drafter = ModelDrafter(tiny_engine(model=tiny_model(seed=2, init_range=0.3)))
    prompt, full, threshold, j = _stop_case(drafter, meta)
    sid, _, _ = drafter.open(prompt, meta, 32)
    stream = drafter.propose(sid, None, [], 8, min_confidence=threshold)
    stopped = list(stream)
    # The same drafts, through the one that took the product below the threshold
    # (it is sent: its forward is already paid).
    assert [d.token_id for d in stopped] == [d.token_id for d in full[: j + 1]]
    products = _products(stopped)
    assert products[-1] < threshold <= products[-2]
    assert stream.done and stream.k == j + 1
    assert drafter.engine.session(sid).length == len(prompt) + j + 1
    # 0 never stops; the session continues from where the short call left it.
    again = list(drafter.propose(sid, len(prompt), [], 8, min_confidence=0.0))
    assert [d.token_id for d in again] == [d.token_id for d in full]


def test_min_confidence_outside_zero_to_one_is_refused():
    drafter = ModelDrafter(tiny_engine(model=tiny_model(seed=2, init_range=0.3)))
    sid, _, _ = drafter.open(PROMPTS[0], GREEDY, 8)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidArgument, match="min_confidence"):
            drafter.propose(sid, None, [], 2, min_confidence=bad)
    ngram = NgramDrafter(vocab_size=128)
    sid, _, _ = ngram.open([1, 2, 3, 1, 2, 3, 1], GREEDY, 8)
    with pytest.raises(InvalidArgument, match="min_confidence"):
        ngram.propose(sid, None, [], 2, min_confidence=2.0)
    # A looked-up token is certain: it never ends the call early.
    assert [d.confidence for d in ngram.propose(sid, None, [], 3, min_confidence=1.0)] == [1.0] * 3


def test_the_draft_service_ends_streamed_and_batched_calls_early_and_sends_each_confidence():
    engine = tiny_engine(model=tiny_model(seed=2, init_range=0.3))
    prompt, full, threshold, j = _stop_case(ModelDrafter(tiny_engine(model=tiny_model(seed=2, init_range=0.3))),
                                            GREEDY)
    with running_draft(engine) as (_, stub, _):
        def request(min_confidence):
            sid = open_session(stub, prompt, seed=1, max_new_tokens=32, temperature=0.0).session_id
            return draft_pb2.ProposeRequest(session_id=sid, num_draft_tokens=8, min_confidence=min_confidence)

        streamed = list(stub.Propose(request(threshold), timeout=T))
        at_once = stub.ProposeAll(draft_pb2.ProposeAllRequest(propose=request(threshold)), timeout=T).drafts
        for drafts in (streamed, list(at_once)):
            assert [d.token_id for d in drafts] == [d.token_id for d in full[: j + 1]]
            assert [d.confidence for d in drafts] == pytest.approx([d.confidence for d in full[: j + 1]], rel=1e-5)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Propose(request(1.5), timeout=T))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_confidence" in err.value.details()


def test_greedy_output_is_identical_to_target_only_when_rounds_end_early():
    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.15, seed=1)
    with running_system(tiny_engine(model=target), tiny_engine(model=draft), draft_min_confidence=0.9) as system:
        short = {"server default": 0, "never": 0}  # rounds that drafted fewer than k = 6
        for prompt in PROMPTS[:5]:
            result = system.client.complete(prompt, max_tokens=24, temperature=0.0, policy="fixed",
                                            num_draft_tokens=6)
            assert result.token_ids == greedy_reference(target, prompt, 24)
            # The request's own value overrides the server's: 0 never stops.
            never = system.client.complete(prompt, max_tokens=24, temperature=0.0, policy="fixed",
                                           num_draft_tokens=6, draft_min_confidence=0.0)
            assert never.token_ids == result.token_ids
            for name, r in (("server default", result), ("never", never)):
                # Rounds near max_tokens are capped (k <= tokens left - 1); the first two never are
                # (a round emits at most 7 of the 24 tokens): a k < 6 there is a stop.
                short[name] += sum(0 < k < 6 for k in r.stats.k_per_round[:2])
        assert short["never"] == 0
        assert short["server default"] > 0, "no round ended early: the test does not exercise the stop"
        with pytest.raises(grpc.RpcError) as err:
            list(system.client.generate(PROMPTS[0], draft_min_confidence=1.5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_min_confidence" in err.value.details()


def test_goodput_with_a_stop_drafts_up_to_the_cap_and_keeps_greedy_output_identical():
    target = tiny_model(seed=0, init_range=1.0)  # peaked: a draft can be sure of several tokens in a row
    draft = perturbed(target, 0.05, seed=1)
    with running_system(tiny_engine(model=target), tiny_engine(model=draft)) as system:
        ks, firsts = [], []
        for prompt in PROMPTS[:4]:
            result = system.client.complete(prompt, max_tokens=32, temperature=0.0, policy="goodput",
                                            num_draft_tokens=2, draft_min_confidence=0.3)
            reference, n = greedy_reference(target, prompt, 32), len(result.token_ids)
            assert result.token_ids == reference[:n] and (n == 32 or reference[n] == 2)  # 2: the tiny models' EOS
            ks += list(result.stats.k_per_round)
            firsts.append(result.stats.k_per_round[0])
        # Before any timing goodput would draft its starting k = 2; with a stop it drafts up to the cap.
        assert max(firsts) > 2, firsts
        assert min(k for k in ks if k) < max(ks), "rounds of different lengths: the stop ended some"


@pytest.mark.slow
def test_sampled_output_is_distributed_as_the_target_when_rounds_end_early():
    """Whether the second draft is made depends on the first draft's q(x),
    so each round's k depends on the draft's own sample: the first two
    tokens must still be distributed as the target's."""
    target = stats_model(0, vocab_size=VOCAB, init_range=0.2)
    draft = stats_model(7, vocab_size=VOCAB, init_range=0.2)
    params = SamplingParams(1.0, 0, 1.0)
    exact = exact_two_token_distribution(target, params)
    # The threshold the first draft's q(x) falls below about half the time.
    with torch.inference_mode():
        q = torch.softmax(draft(torch.tensor([PROMPT])).logits[0, -1].float(), -1).sort().values
    threshold = float(q[int(torch.searchsorted(q.cumsum(0), torch.tensor(0.5)))])
    with running_system(tiny_engine(model=target), tiny_engine(model=draft)) as s:
        results = complete_seeds(s, PROMPT, range(SAMPLES), max_tokens=3, temperature=1.0, policy="fixed",
                                 num_draft_tokens=2, draft_min_confidence=threshold)
    counts: dict[tuple, int] = {}
    for r in results:
        key = tuple(r.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    first_k = [r.stats.k_per_round[0] for r in results]
    assert first_k.count(1) > SAMPLES // 10 and first_k.count(2) > SAMPLES // 10  # both kinds of round happen
    assert_matches(counts, exact, SAMPLES)


def test_drafts_made_ahead_stop_where_a_propose_after_the_guess_would():
    """A speculative Propose drafts a guess at the bonus token, then the next
    round's drafts. The guess is left out of the early stop's product
    (first_is_guess), so the drafts after it are those of a Propose sent once
    the guess is known: counted, an unsure guess ended the call at once."""
    drafter = ModelDrafter(tiny_engine(seed=0), max_draft_tokens=8)
    meta = SessionMeta(params=SamplingParams(0.9, 0, 1.0), seed=7)
    sid, n, _ = drafter.open([3, 10, 17, 24, 31, 38], meta, 64)
    ahead = list(drafter.propose(sid, n, [], 5, min_confidence=0.05, first_is_guess=True))
    fresh = list(drafter.propose(sid, n, [ahead[0].token_id], 4, min_confidence=0.05))
    assert len(fresh) >= 1
    assert [d.token_id for d in ahead[1:]] == [d.token_id for d in fresh]
    counted = list(drafter.propose(sid, n, [], 5, min_confidence=0.05))
    assert len(counted) < len(ahead)  # the guess's own confidence stopped it
