"""The draft service over the n-gram drafter (no model): its proposals, its
refusals, and its point-mass q through the target.
"""
from __future__ import annotations

import pytest

from specdec.v1 import common_pb2
from tests.harness import running_draft
from tests.service_calls import (
    Code,
    SAMPLED,
    T,
    V,
    close,
    expect_status,
    item,
    open_session,
    propose,
    rollback,
    verify,
)
from tests.service_calls import target  # noqa: F401 - pytest fixtures, used by name


# ------------------------------------------------------- n-gram drafter


@pytest.fixture(scope="module")
def ngram():
    with running_draft(ngram_vocab=V) as running:
        yield running


def test_ngram_proposes_the_continuation_of_a_repeated_pattern(ngram):
    _, stub, _ = ngram
    info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=T).info
    assert info.backend == "ngram" and info.vocab_size == V
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    sid = open_session(stub, prompt).session_id
    out = propose(stub, sid, 4)
    assert [d.token_id for d in out] == [8, 9, 5, 6]
    assert [d.length for d in out] == [9, 10, 11, 12] and [d.index for d in out] == [0, 1, 2, 3]
    assert all(not d.HasField("q") for d in out)
    # Reject all four, append 9: the latest "9" was followed by 5, 6, 7.
    assert [d.token_id for d in propose(stub, sid, 3, keep=8, append=[9])] == [5, 6, 7]
    close(stub, sid)


def test_ngram_follows_the_latest_earlier_match(ngram):
    """Two earlier occurrences of the suffix: the continuation of the most
    recent one is proposed (every other test has one match, so scanning from
    the earliest went unnoticed)."""
    _, stub, _ = ngram
    sid = open_session(stub, [1, 2, 9, 1, 3, 9, 1]).session_id
    assert [d.token_id for d in propose(stub, sid, 2)] == [3, 9]
    close(stub, sid)


def test_ngram_refuses_bad_sessions(ngram):
    _, stub, _ = ngram
    expect_status(Code.INVALID_ARGUMENT, "max_new_tokens", open_session, stub, [1, 2], max_new_tokens=-1)
    expect_status(Code.INVALID_ARGUMENT, "empty", open_session, stub, [])
    expect_status(Code.INVALID_ARGUMENT, "outside the vocabulary", open_session, stub, [V])
    sid = open_session(stub, [1, 2, 1]).session_id
    expect_status(Code.INVALID_ARGUMENT, "num_draft_tokens", propose, stub, sid, 0)
    expect_status(Code.OUT_OF_RANGE, "holds only 3", propose, stub, sid, 2, keep=4)
    # Found by the fuzzer: keep 0 with nothing appended emptied the session (the model drafter refuses it).
    expect_status(Code.INVALID_ARGUMENT, "keep or append at least one token", propose, stub, sid, 2, keep=0)
    assert rollback(stub, sid, 3) == 3  # the refused call left the context whole
    close(stub, sid)


def test_ngram_with_nothing_matching_proposes_nothing(ngram):
    _, stub, _ = ngram
    sid = open_session(stub, [10, 11, 12, 13]).session_id
    assert propose(stub, sid, 4) == []
    assert rollback(stub, sid, 4) == 4  # nothing was appended
    close(stub, sid)


def test_ngram_sampled_sends_a_point_mass_q_the_target_accepts(ngram, target):
    _, stub, _ = ngram
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    sid = open_session(stub, prompt, seed=3, **SAMPLED).session_id
    out = propose(stub, sid, 3)
    assert [d.token_id for d in out] == [8, 9, 5]
    for d in out:
        assert list(d.q.token_ids) == [d.token_id] and list(d.q.probs) == [1.0]
    t_sid = open_session(target[1], prompt, seed=3, **SAMPLED).session_id
    q = [(list(d.q.token_ids), list(d.q.probs)) for d in out]
    result = verify(target[1], item(t_sid, [d.token_id for d in out], q))[0]
    assert not result.HasField("error") and len(result.target_probs) == 3
    close(stub, sid)
    close(target[1], t_sid)
