"""Bad input to the draft and target services: each bad call gets its status
and message, and leaves every other session as it was (the reference
sessions of tests/service_calls.py are checked before and after).
"""
from __future__ import annotations

import grpc
import pytest

from specdec.rpc.session_limits import SessionLimits
from specdec.v1 import target_pb2
from tests.conftest import tiny_engine
from tests.harness import local_config, running_target, wait_until
from tests.service_calls import (
    Code,
    INVALID,
    NOT_FOUND,
    OUT_OF_RANGE,
    SAMPLED,
    T,
    TARGET_MODEL,
    V,
    assert_same_verify,
    close,
    decode,
    expect_status,
    item,
    open_session,
    propose,
    rollback,
    spread_q,
    tokens,
    verify,
)
from tests.service_calls import draft, reference, short_ttl, target, untouched  # noqa: F401 - pytest fixtures, used by name


# ------------------------------------------------------------ bad input


@pytest.fixture
def victims(target, draft):
    """Fresh sessions of 8 tokens to aim bad calls at: target greedy and
    sampled, draft greedy."""
    prompt = tokens(8, seed=8)
    t, d = target[1], draft[1]
    sids = {
        "greedy": open_session(t, prompt).session_id,
        "sampled": open_session(t, prompt, seed=1, **SAMPLED).session_id,
        "draft": open_session(d, prompt).session_id,
    }
    yield sids
    for key, sid in sids.items():
        close(d if key == "draft" else t, sid)


def _lengths(target, draft, victims) -> dict:
    t_engine = target[0].servicer.backend.engine
    d_engine = draft[0].servicer.backend.engine
    return {key: (d_engine if key == "draft" else t_engine).session(sid).length for key, sid in victims.items()}


LIMIT = SessionLimits().max_draft_tokens

# (case id, service, call(stub, victims) , expected code, message fragment)
STATUS_CASES = [
    ("unknown-session-target-rollback", "target", lambda s, v: rollback(s, "no-such-session", 1),
     Code.NOT_FOUND, "unknown or expired"),
    ("unknown-session-target-decode", "target", lambda s, v: decode(s, "no-such-session", 1),
     Code.NOT_FOUND, "unknown or expired"),
    ("unknown-session-draft-propose", "draft", lambda s, v: propose(s, "no-such-session", 2),
     Code.NOT_FOUND, "unknown or expired"),
    ("unknown-session-draft-rollback", "draft", lambda s, v: rollback(s, "", 0),
     Code.NOT_FOUND, "unknown or expired"),
    ("empty-prompt-target", "target", lambda s, v: open_session(s, []), Code.INVALID_ARGUMENT, "empty"),
    ("empty-prompt-draft", "draft", lambda s, v: open_session(s, []), Code.INVALID_ARGUMENT, "empty"),
    ("prompt-id-negative-target", "target", lambda s, v: open_session(s, [1, -1]),
     Code.INVALID_ARGUMENT, "outside the vocabulary"),
    ("prompt-id-vocab-target", "target", lambda s, v: open_session(s, [V]),
     Code.INVALID_ARGUMENT, "outside the vocabulary"),
    ("prompt-id-vocab-draft", "draft", lambda s, v: open_session(s, [1, V]),
     Code.INVALID_ARGUMENT, "outside the vocabulary"),
    ("append-id-propose", "draft", lambda s, v: propose(s, v["draft"], 2, append=[V]),
     Code.INVALID_ARGUMENT, "outside the vocabulary"),
    ("append-id-decode", "target", lambda s, v: decode(s, v["greedy"], 2, append=[-5]),
     Code.INVALID_ARGUMENT, "outside the vocabulary"),
    ("context-overflow-target", "target", lambda s, v: open_session(s, [1, 2], max_new_tokens=1023),
     Code.INVALID_ARGUMENT, "context limit"),
    ("context-overflow-draft", "draft", lambda s, v: open_session(s, [1, 2], max_new_tokens=5000),
     Code.INVALID_ARGUMENT, "context limit"),
    ("max-new-tokens-negative-target", "target", lambda s, v: open_session(s, [1, 2], max_new_tokens=-1),
     Code.INVALID_ARGUMENT, "max_new_tokens"),
    ("max-new-tokens-negative-draft", "draft", lambda s, v: open_session(s, [1, 2], max_new_tokens=-1),
     Code.INVALID_ARGUMENT, "max_new_tokens"),
    ("propose-k-0", "draft", lambda s, v: propose(s, v["draft"], 0), Code.INVALID_ARGUMENT,
     f"num_draft_tokens must be in [1, {LIMIT}], got 0"),
    ("propose-k-negative", "draft", lambda s, v: propose(s, v["draft"], -2), Code.INVALID_ARGUMENT,
     "num_draft_tokens"),
    ("propose-k-over-limit", "draft", lambda s, v: propose(s, v["draft"], LIMIT + 1),
     Code.INVALID_ARGUMENT, f"num_draft_tokens must be in [1, {LIMIT}], got {LIMIT + 1}"),
    ("decode-num-tokens-0", "target", lambda s, v: decode(s, v["greedy"], 0), Code.INVALID_ARGUMENT, "num_tokens"),
    ("rollback-past-end-target", "target", lambda s, v: rollback(s, v["greedy"], 9),
     Code.OUT_OF_RANGE, "holds only 8"),
    ("rollback-past-end-draft", "draft", lambda s, v: rollback(s, v["draft"], 100),
     Code.OUT_OF_RANGE, "holds only 8"),
    ("rollback-negative", "target", lambda s, v: rollback(s, v["greedy"], -1), Code.INVALID_ARGUMENT,
     "at least 1 token"),
    ("rollback-to-0-target", "target", lambda s, v: rollback(s, v["greedy"], 0), Code.INVALID_ARGUMENT,
     "at least 1 token, got length 0"),
    ("rollback-to-0-draft", "draft", lambda s, v: rollback(s, v["draft"], 0), Code.INVALID_ARGUMENT,
     "at least 1 token, got length 0"),
    ("keep-past-end-propose", "draft", lambda s, v: propose(s, v["draft"], 2, keep=9),
     Code.OUT_OF_RANGE, "holds only 8"),
    ("keep-past-end-decode", "target", lambda s, v: decode(s, v["greedy"], 2, keep=9),
     Code.OUT_OF_RANGE, "holds only 8"),
    ("keep-negative-propose", "draft", lambda s, v: propose(s, v["draft"], 2, keep=-1),
     Code.INVALID_ARGUMENT, ">= 0"),
    ("nothing-to-draft-from", "draft", lambda s, v: propose(s, v["draft"], 2, keep=0),
     Code.INVALID_ARGUMENT, "keep or append at least one token"),
    ("nothing-to-decode-from", "target", lambda s, v: decode(s, v["greedy"], 2, keep=0),
     Code.INVALID_ARGUMENT, "keep or append at least one token"),
]
for _role in ("target", "draft"):
    for _name, _sampling, _match in (
        ("temperature-nan", dict(temperature=float("nan")), "temperature"),
        ("temperature-negative", dict(temperature=-0.5), "temperature"),
        ("temperature-inf", dict(temperature=float("inf")), "temperature"),
        ("top-p-1.5", dict(temperature=0.7, top_p=1.5), "top_p"),
        ("top-p-negative", dict(temperature=0.7, top_p=-0.1), "top_p"),
        ("top-k-negative", dict(temperature=0.7, top_k=-1), "top_k"),
    ):
        STATUS_CASES.append((f"{_name}-{_role}", _role,
                             lambda s, v, _sp=_sampling: open_session(s, [1, 2], **_sp),
                             Code.INVALID_ARGUMENT, _match))


@pytest.mark.parametrize("case", STATUS_CASES, ids=[c[0] for c in STATUS_CASES])
def test_bad_call_gets_its_status(target, draft, victims, untouched, case):
    _, role, call, code, match = case
    stub = target[1] if role == "target" else draft[1]
    before = _lengths(target, draft, victims)
    expect_status(code, match, call, stub, victims)
    assert _lengths(target, draft, victims) == before, "a refused call changed its session"


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("length", [0, -1, -(2**31)])
def test_a_refused_rollback_leaves_the_session_usable(target, draft, role, length):
    """Issue 16 item 6: a Rollback below 1 token is INVALID_ARGUMENT, past the
    end OUT_OF_RANGE, and afterwards the session answers exactly as a twin
    session that was never sent the bad calls."""
    stub = target[1] if role == "target" else draft[1]
    prompt = tokens(9, seed=31)
    victim, twin = (open_session(stub, prompt, seed=5, **SAMPLED).session_id for _ in range(2))
    expect_status(Code.INVALID_ARGUMENT, f"at least 1 token, got length {length}", rollback, stub, victim, length)
    expect_status(Code.OUT_OF_RANGE, "holds only 9", rollback, stub, victim, 10)
    if role == "target":
        drafts = [4, 5, 6]
        got, want = (verify(stub, item(sid, drafts, [spread_q(x) for x in drafts]))[0] for sid in (victim, twin))
        want.session_id = victim
        assert_same_verify(got, want)
    else:
        got, want = (propose(stub, sid, 4) for sid in (victim, twin))
        assert [(d.token_id, d.length, list(d.q.token_ids)) for d in got] == \
            [(d.token_id, d.length, list(d.q.token_ids)) for d in want]
    assert rollback(stub, victim, 9) == 9  # and a good rollback still works
    for sid in (victim, twin):
        close(stub, sid)


_CORRUPT, _TRUNCATED, _BAD_UTF8 = b"\xff\xff\xff", b"\x0a\x05\xff\xfe", b"\x0a\x02\xc3\x28"
RAW_CASES = [("target", "/specdec.v1.TargetService/OpenSession", False, _CORRUPT),
             ("target", "/specdec.v1.TargetService/Verify", False, _TRUNCATED),
             ("draft", "/specdec.v1.DraftService/Propose", True, _CORRUPT),
             ("draft", "/specdec.v1.DraftService/Propose", True, _BAD_UTF8),  # session_id is not UTF-8
             ("draft", "/specdec.v1.DraftService/Rollback", False, _BAD_UTF8)]


@pytest.mark.parametrize("role, path, streaming, data", RAW_CASES,
                         ids=["open-corrupt", "verify-truncated", "propose-corrupt", "propose-bad-utf8",
                              "rollback-bad-utf8"])
def test_bytes_that_are_no_message_are_invalid_argument(target, draft, untouched, role, path, streaming, data):
    """Found by the fuzzer: grpc.aio answered these UNKNOWN ("Unexpected
    DecodeError") before any servicer code ran (specdec/rpc/malformed.py)."""
    port = (target if role == "target" else draft)[0].port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = (channel.unary_stream if streaming else channel.unary_unary)(
            path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        err = expect_status(Code.INVALID_ARGUMENT, "not a valid protobuf message",
                            lambda: list(method(data, timeout=T)) if streaming else method(data, timeout=T))
        assert path in err.details()


def _q_for(bad: str, drafts: list[int]):
    good = [spread_q(x) for x in drafts]
    x = drafts[0]
    first = {
        "lengths-differ": ([x, 1], [1.0]),
        "duplicate-ids": ([x, x], [0.5, 0.5]),
        "negative-prob": ([x, 1, 2], [1.2, -0.4, 0.2]),
        "nan-prob": ([x, 1], [float("nan"), 0.5]),
        "sum-not-1": ([x, 1], [0.5, 0.3]),
        "drafted-not-in-q": ([(x + 1) % V], [1.0]),
        "drafted-has-zero-mass": ([x, (x + 1) % V], [0.0, 1.0]),
        "id-outside-vocab": ([x, V], [0.5, 0.5]),
        "empty-q": ([], []),
    }.get(bad)
    if bad == "count-differs":
        return good[:-1]
    return [first, *good[1:]]


# (case id, item builder(victims) -> VerifyItem, expected item code, message fragment)
ITEM_CASES = [
    ("unknown-session", lambda v: item("no-such-session", [1, 2]), NOT_FOUND, "unknown or expired"),
    ("append-id-outside-vocab", lambda v: item(v["greedy"], [1], append=[V]), INVALID, "outside the vocabulary"),
    ("draft-id-outside-vocab", lambda v: item(v["greedy"], [1, V + 3]), INVALID, "outside the vocabulary"),
    ("draft-id-negative", lambda v: item(v["greedy"], [-1]), INVALID, "outside the vocabulary"),
    ("too-many-drafts", lambda v: item(v["greedy"], [1] * (LIMIT + 1)), INVALID,
     f"num_draft_tokens must be in [0, {LIMIT}], got {LIMIT + 1}"),
    ("keep-past-end", lambda v: item(v["greedy"], [1], keep=9), OUT_OF_RANGE, "holds only 8"),
    ("keep-negative", lambda v: item(v["greedy"], [1], keep=-3), INVALID, ">= 0"),
    ("nothing-before-drafts", lambda v: item(v["greedy"], [1], keep=0), INVALID, "nothing precedes"),
    ("same-session-twice", lambda v: item(v["greedy"], [1]), INVALID, "twice"),  # see the test
]
for _bad, _match in (("lengths-differ", "token ids but"), ("duplicate-ids", "duplicate"),
                     ("negative-prob", "negative"), ("nan-prob", "nan"), ("sum-not-1", "sums to"),
                     ("drafted-not-in-q", "probability 0"), ("drafted-has-zero-mass", "probability 0"),
                     ("id-outside-vocab", "outside"), ("empty-q", "empty"),
                     ("count-differs", "proposal distributions")):
    ITEM_CASES.append((f"q-{_bad}", lambda v, _b=_bad: item(v["sampled"], [4, 5, 6], _q_for(_b, [4, 5, 6])),
                       INVALID, _match))


@pytest.mark.parametrize("case", ITEM_CASES, ids=[c[0] for c in ITEM_CASES])
def test_bad_verify_item_fails_alone(target, draft, victims, untouched, case):
    """The bad item gets its own error; the reference item of the same call succeeds."""
    name, build, code, match = case
    stub = target[1]
    before = _lengths(target, draft, victims)
    bad = build(victims)
    items = [untouched.item(), bad]
    if name == "same-session-twice":
        items = [untouched.item(), item(victims["greedy"], [2]), bad]
    response = stub.Verify(target_pb2.VerifyRequest(items=items), timeout=T)
    ref, failed = response.results[0], response.results[-1]
    assert failed.error.code == code, failed.error
    assert match.lower() in failed.error.message.lower(), failed.error.message
    untouched.check(verified=ref)  # the good item of the same call
    after = _lengths(target, draft, victims)
    if name == "same-session-twice":
        before["greedy"] += 1  # the first occurrence of the session was verified
    assert after == before


def test_propose_beyond_the_context_is_refused_before_drafting(draft, untouched):
    _, stub, _ = draft
    engine = draft[0].servicer.backend.engine
    sid = open_session(stub, tokens(1020, seed=10)).session_id  # the tiny model's limit is 1024
    expect_status(Code.OUT_OF_RANGE, "context limit", propose, stub, sid, 8)
    assert engine.session(sid).length == 1020, "a refused Propose drafted some tokens"
    assert [d.length for d in propose(stub, sid, 4)] == [1021, 1022, 1023, 1024]
    close(stub, sid)


def test_message_over_the_size_limit_is_resource_exhausted():
    engine = tiny_engine(model=TARGET_MODEL)
    with running_target(engine, server_cfg=local_config(max_message_bytes=4096)) as (_, stub, _):
        expect_status(Code.RESOURCE_EXHAUSTED, "", open_session, stub, [100] * 6000)
        assert open_session(stub, [1, 2, 3]).length == 3  # still serving


def test_expired_session_is_not_found(short_ttl):
    t_engine, t_stub, d_engine, d_stub = short_ttl
    t_sid = open_session(t_stub, [1, 2, 3]).session_id
    d_sid = open_session(d_stub, [1, 2, 3]).session_id
    wait_until(lambda: t_engine.num_sessions == 0 and d_engine.num_sessions == 0, timeout_s=20.0)
    expect_status(Code.NOT_FOUND, "unknown or expired", rollback, t_stub, t_sid, 1)
    expect_status(Code.NOT_FOUND, "unknown or expired", decode, t_stub, t_sid, 1)
    expect_status(Code.NOT_FOUND, "unknown or expired", propose, d_stub, d_sid, 1)
    expect_status(Code.NOT_FOUND, "unknown or expired", rollback, d_stub, d_sid, 1)
    live = open_session(t_stub, [4, 5, 6]).session_id  # opened just before its use: well within its lifetime
    results = verify(t_stub, item(t_sid, [1]), item(live, [1]))
    assert results[0].error.code == NOT_FOUND and "expired" in results[0].error.message
    assert not results[1].HasField("error") and len(results[1].argmax_token_ids) == 2
    assert close(t_stub, t_sid) is False and close(d_stub, d_sid) is False
    close(t_stub, live)
