"""A fuzz test of the draft and target services' request fields: whatever the
wire allows gets a proper status, never a crash, and the reference sessions
(tests/service_calls.py) keep their results.
"""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_service.server import SERVICE_NAME as DRAFT_SERVICE
from specdec.v1 import common_pb2, target_pb2
from target_service.server import SERVICE_NAME as TARGET_SERVICE
from tests.service_calls import (
    Code,
    T,
    V,
    close,
    health_status,
    item,
    open_session,
    propose,
    rollback,
    spread_q,
    tokens,
    verify,
)
from tests.service_calls import draft, reference, target  # noqa: F401 - pytest fixtures, used by name


# ---------------------------------------------------------------- fuzzing

BAD_CODES = {Code.INTERNAL, Code.UNKNOWN, Code.DEADLINE_EXCEEDED}
INT32 = st.integers(-(2**31), 2**31 - 1)
F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
# Each field is drawn sane (so calls get deep into the services) or wild (anything the wire allows).
SANE = dict(
    token=st.integers(0, V - 1),
    keep=st.one_of(st.none(), st.integers(1, 10)),
    k=st.integers(1, 8),
    sampling=st.builds(common_pb2.SamplingParams, temperature=st.sampled_from([0.0, 0.5, 0.7, 1.3]),
                       top_k=st.integers(0, 50), top_p=st.sampled_from([0.0, 0.5, 0.9, 1.0])),
    max_new=st.integers(0, 100),
    length=st.integers(0, 10),
)
WILD = dict(
    token=st.one_of(st.integers(-3, V + 3), INT32),
    keep=st.one_of(st.integers(-3, 40), INT32),
    k=st.one_of(st.integers(-3, 40), INT32),
    sampling=st.builds(common_pb2.SamplingParams, temperature=F32, top_k=st.one_of(st.integers(-3, 200), INT32),
                       top_p=F32),
    max_new=st.one_of(st.integers(-5, 2000), INT32),
    length=st.one_of(st.integers(-3, 40), INT32),
)
SESSION_KEYS = st.sampled_from(["live", "live", "live", "closed", "garbage"])


@st.composite
def field(draw, name):
    return draw(WILD[name] if draw(st.integers(0, 3)) == 0 else SANE[name])


@st.composite
def token_list(draw, max_size, min_size=0):
    """Sane lists (every id in the vocabulary, at least min_size) or any lists."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(st.one_of(SANE["token"], WILD["token"]), max_size=max_size))
    return draw(st.lists(SANE["token"], min_size=min_size, max_size=max_size))


@st.composite
def draft_qs(draw, drafts):
    """q lists: valid (point masses or spread), or random ids and probabilities."""
    wild_q = st.lists(st.tuples(field("token"), st.one_of(st.floats(0, 1, width=32), F32)), max_size=5)
    return draw(st.one_of(
        st.just([([x], [1.0]) for x in drafts]),
        st.just([spread_q(x % V) for x in drafts]),
        st.lists(wild_q.map(lambda e: ([i for i, _ in e], [p for _, p in e])), max_size=6),
    ))


@st.composite
def fuzz_calls(draw):
    """A few calls on the example's sessions ("live"), closed ones and garbage ids."""
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["open", "propose", "propose", "verify", "verify", "verify", "decode", "decode",
                                   "rollback", "close"]))
        args = dict(sid=draw(SESSION_KEYS), service=draw(st.sampled_from(["target", "draft"])))
        if op == "open":
            args.update(prompt=draw(token_list(12, min_size=1)), sampling=draw(field("sampling")),
                        seed=draw(st.integers(0, 2**64 - 1)), max_new=draw(field("max_new")))
        elif op == "propose":
            args.update(keep=draw(field("keep")), append=draw(token_list(3)), k=draw(field("k")))
        elif op == "verify":
            entries = []
            for _ in range(draw(st.integers(1, 3))):
                drafts = draw(token_list(6))
                entries.append(dict(sid=draw(SESSION_KEYS), keep=draw(field("keep")), append=draw(token_list(3)),
                                    drafts=drafts, q=draw(draft_qs(drafts))))
            args.update(items=entries)
        elif op == "decode":
            args.update(keep=draw(field("keep")), append=draw(token_list(3)), k=draw(field("k")),
                        stops=draw(token_list(3)))
        elif op == "rollback":
            args.update(length=draw(field("length")))
        calls.append((op, args))
    return draw(field("sampling")), draw(st.integers(0, 2**64 - 1)), calls


def _run_fuzz_call(t_stub, d_stub, ids, op, a, opened):
    stub = t_stub if a["service"] == "target" else d_stub

    def sid_of(key, service):
        return ids[service].get(key, "")

    if op == "open":
        req = common_pb2.OpenSessionRequest(prompt_token_ids=a["prompt"], sampling=a["sampling"], seed=a["seed"],
                                            max_new_tokens=a["max_new"])
        opened.append((stub, stub.OpenSession(req, timeout=T).session_id))
    elif op == "propose":
        out = propose(d_stub, sid_of(a["sid"], "draft"), a["k"], keep=a["keep"], append=a["append"])
        assert len(out) == a["k"]
    elif op == "verify":
        items = [item(sid_of(e["sid"], "target"), e["drafts"], e["q"], keep=e["keep"], append=e["append"])
                 for e in a["items"]]
        for e, r in zip(a["items"], verify(t_stub, *items)):
            if r.HasField("error"):
                assert r.error.code not in (0, Code.INTERNAL.value[0], Code.UNKNOWN.value[0]), r.error
                assert r.error.message
            else:
                k = len(e["drafts"])
                assert len(r.argmax_token_ids) == k + 1 or len(r.target_probs) == len(r.recovery_token_ids) == k
    elif op == "decode":
        req = target_pb2.DecodeRequest(session_id=sid_of(a["sid"], "target"), num_tokens=a["k"],
                                       append_token_ids=a["append"], stop_token_ids=a["stops"])
        if a["keep"] is not None:
            req.keep_length = a["keep"]
        t_stub.Decode(req, timeout=T)
    elif op == "rollback":
        rollback(stub, sid_of(a["sid"], a["service"]), a["length"])
    elif op == "close":
        close(stub, sid_of(a["sid"], a["service"]))


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fuzz_calls())
def test_fuzzed_requests_never_break_the_services(target, draft, reference, case):
    t_stub, d_stub = target[1], draft[1]
    session_sampling, seed, calls = case
    prompt = tokens(6, seed=seed % 1000)
    ids = {"target": {"garbage": "x" * (seed % 40)}, "draft": {"garbage": "%" * (seed % 7)}}
    opened = []
    for service, stub in (("target", t_stub), ("draft", d_stub)):
        req = common_pb2.OpenSessionRequest(prompt_token_ids=prompt, sampling=session_sampling, seed=seed)
        try:
            live = stub.OpenSession(req, timeout=T).session_id
        except grpc.RpcError as err:
            assert err.code() == Code.INVALID_ARGUMENT, (err.code(), err.details())
            live = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=prompt), timeout=T).session_id
        closed = open_session(stub, [1]).session_id
        close(stub, closed)
        ids[service].update(live=live, closed=closed)
        opened.append((stub, live))
    try:
        for op, args in calls:
            try:
                _run_fuzz_call(t_stub, d_stub, ids, op, args, opened)
            except grpc.RpcError as err:
                assert err.code() not in BAD_CODES, (op, args, err.code(), err.details())
                assert err.details(), (op, args, err.code())
    finally:
        for stub, sid in opened:
            close(stub, sid)
    for port, name in ((target[0].port, TARGET_SERVICE), (draft[0].port, DRAFT_SERVICE)):
        assert health_status(port, name) == health_pb2.HealthCheckResponse.SERVING
    reference.check()
