"""The draft and target services over gRPC, in-process on 127.0.0.1:0 with tiny
random models: round trips, batching, health, sessions, bad input, a fuzz test
of the request fields, and the n-gram drafter.

Most tests share one draft+target pair (module fixtures) and a reference
session on each service; every bad call is bracketed by a check that the
reference sessions still give exactly the results they gave at the start.
"""
from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_service.drafters import ModelDrafter
from draft_service.server import SERVICE_NAME as DRAFT_SERVICE, start_draft_service
from specdec.rpc.model_service import SessionLimits
from specdec.sampling.params import SamplingParams
from specdec.sampling.sparse import truncate
from specdec.sampling.transform import logits_to_probs
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.server import SERVICE_NAME as TARGET_SERVICE, start_target_service
from target_service.verifier import Verifier
from tests.conftest import TINY_VOCAB, tiny_engine, tiny_model
from tests.harness import BackgroundLoop, local_config, running_draft, running_target

T = 10.0  # deadline of every client call, seconds
V = TINY_VOCAB
Code = grpc.StatusCode
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.7)
NOT_FOUND, INVALID, OUT_OF_RANGE = Code.NOT_FOUND.value[0], Code.INVALID_ARGUMENT.value[0], Code.OUT_OF_RANGE.value[0]

# Peaked (tie-free) random models, so greedy comparisons are meaningful.
TARGET_MODEL = tiny_model("llama", seed=0, init_range=0.3)
DRAFT_MODEL = tiny_model("llama", seed=1, init_range=0.3)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (n,), generator=g).tolist()


# ------------------------------------------------------------------ helpers


def open_session(stub, prompt, seed=0, max_new_tokens=0, **sampling) -> common_pb2.OpenSessionResponse:
    req = common_pb2.OpenSessionRequest(prompt_token_ids=prompt, seed=seed, max_new_tokens=max_new_tokens,
                                        sampling=common_pb2.SamplingParams(**sampling))
    return stub.OpenSession(req, timeout=T)


def propose(stub, sid, k, keep=None, append=()) -> list[draft_pb2.ProposeResponse]:
    req = draft_pb2.ProposeRequest(session_id=sid, num_draft_tokens=k, append_token_ids=list(append))
    if keep is not None:
        req.keep_length = keep
    return list(stub.Propose(req, timeout=T))


def item(sid, drafts=(), q=(), keep=None, append=()) -> target_pb2.VerifyItem:
    msg = target_pb2.VerifyItem(session_id=sid, draft_token_ids=list(drafts), append_token_ids=list(append),
                                draft_q=[common_pb2.SparseDistribution(token_ids=i, probs=p) for i, p in q])
    if keep is not None:
        msg.keep_length = keep
    return msg


def verify(stub, *items) -> list[target_pb2.VerifyResult]:
    return list(stub.Verify(target_pb2.VerifyRequest(items=items), timeout=T).results)


def decode(stub, sid, n, keep=None, append=()) -> target_pb2.DecodeResponse:
    req = target_pb2.DecodeRequest(session_id=sid, num_tokens=n, append_token_ids=list(append))
    if keep is not None:
        req.keep_length = keep
    return stub.Decode(req, timeout=T)


def rollback(stub, sid, length) -> int:
    return stub.Rollback(common_pb2.RollbackRequest(session_id=sid, length=length), timeout=T).length


def close(stub, sid) -> bool:
    return stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=T).closed


def spread_q(x: int) -> tuple[list[int], list[float]]:
    """A valid sparse q containing the drafted token x (sums to 1 exactly in float32)."""
    return [x, (x + 1) % V, (x + 7) % V], [0.5, 0.25, 0.25]


def expect_status(code: Code, match: str, fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.code() == code, (err.code(), err.details())
    assert match.lower() in err.details().lower(), err.details()
    return err


def health_status(port: int, service: str):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(req, timeout=T).status


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding, cache-free, in fp32."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def reference_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([seq])).logits[0]  # [n, V]


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target():
    engine = tiny_engine(model=TARGET_MODEL, max_sessions=64)
    with running_target(engine) as running:
        yield running


@pytest.fixture(scope="module")
def draft():
    engine = tiny_engine(model=DRAFT_MODEL, max_sessions=64)
    with running_draft(engine) as running:
        yield running


@dataclass
class Reference:
    """A sampled session on each service whose results must never change."""

    target_stub: object
    draft_stub: object
    target_sid: str
    draft_sid: str
    prompt: list[int]
    drafts: list[int]
    expected: tuple

    def item(self) -> target_pb2.VerifyItem:
        return item(self.target_sid, self.drafts, [spread_q(x) for x in self.drafts], keep=len(self.prompt))

    def results(self) -> tuple:
        """Rolled back to its start, the same calls give the same answers."""
        assert rollback(self.target_stub, self.target_sid, len(self.prompt)) == len(self.prompt)
        verified = verify(self.target_stub, self.item())[0]
        assert rollback(self.draft_stub, self.draft_sid, len(self.prompt)) == len(self.prompt)
        proposed = propose(self.draft_stub, self.draft_sid, 3)
        return verified, proposed

    def check(self, verified: target_pb2.VerifyResult | None = None) -> None:
        """The reference results are unchanged (`verified`: one from a batch of the caller's)."""
        now_verified, now_proposed = self.results()
        assert_same_verify(verified or now_verified, self.expected[0])
        assert len(now_proposed) == len(self.expected[1])
        for a, b in zip(now_proposed, self.expected[1]):
            assert (a.index, a.token_id, a.length, list(a.q.token_ids)) == (b.index, b.token_id, b.length,
                                                                            list(b.q.token_ids))
            assert list(a.q.probs) == pytest.approx(list(b.q.probs), abs=1e-6)


def assert_same_verify(a: target_pb2.VerifyResult, b: target_pb2.VerifyResult) -> None:
    """Equal results: the same tokens; p_i(x_i) within 1e-5 (a batch pads rows,
    which may move float32 sums by an ulp)."""
    assert not a.HasField("error") and not b.HasField("error"), (a.error, b.error)
    assert (a.session_id, a.length, list(a.argmax_token_ids), list(a.recovery_token_ids), a.bonus_token_id) == \
        (b.session_id, b.length, list(b.argmax_token_ids), list(b.recovery_token_ids), b.bonus_token_id)
    torch.testing.assert_close(torch.tensor(list(a.target_probs)), torch.tensor(list(b.target_probs)),
                               atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def reference(target, draft):
    prompt = tokens(12, seed=99)
    tsid = open_session(target[1], prompt, seed=7, top_k=40, **SAMPLED).session_id
    dsid = open_session(draft[1], prompt, seed=7, top_k=40, **SAMPLED).session_id
    ref = Reference(target[1], draft[1], tsid, dsid, prompt, [10, 20, 30], expected=())
    ref.expected = ref.results()
    ref.check()
    return ref


@pytest.fixture
def untouched(reference):
    """Check the reference sessions before and after the test body."""
    reference.check()
    yield reference
    reference.check()


# ------------------------------------------------------------ 1. round trips

SAMPLINGS = {
    "greedy": GREEDY,
    "T0.7": dict(temperature=0.7),
    "T0.7-topk5": dict(temperature=0.7, top_k=5),
    "T0.7-topp0.9": dict(temperature=0.7, top_p=0.9),
}


@pytest.mark.parametrize("name", SAMPLINGS)
def test_draft_round_trip(draft, name):
    _, stub, _ = draft
    sampling = SAMPLINGS[name]
    params = SamplingParams.from_wire(sampling.get("temperature", 0), sampling.get("top_k", 0),
                                      sampling.get("top_p", 0))
    prompt = tokens(9, seed=1)
    opened = open_session(stub, prompt, seed=5, **sampling)
    sid, n = opened.session_id, len(prompt)
    assert opened.length == n and opened.kv_bytes > 0

    drafts = propose(stub, sid, 4)
    assert [d.index for d in drafts] == [0, 1, 2, 3]
    assert [d.length for d in drafts] == [n + 1, n + 2, n + 3, n + 4]
    ids = [d.token_id for d in drafts]
    if params.greedy:
        assert all(not d.HasField("q") for d in drafts)
        assert ids == greedy_reference(DRAFT_MODEL, prompt, 4)
    else:
        logits = reference_logits(DRAFT_MODEL, prompt + ids)[n - 1 : n + 3]  # rows predicting x_1..x_4
        for d, row in zip(drafts, logits):
            q_ids, q_probs = list(d.q.token_ids), list(d.q.probs)
            assert 1 <= len(q_ids) <= 32 and len(set(q_ids)) == len(q_ids)
            assert all(0 <= t < V for t in q_ids) and all(p >= 0 for p in q_probs)
            assert math.isclose(sum(q_probs), 1.0, abs_tol=1e-6) and d.token_id in q_ids
            if params.top_k:
                assert len(q_ids) <= params.top_k
            expected = truncate(logits_to_probs(row[None], params)[0], 32)
            assert q_ids == expected.token_ids.tolist()
            torch.testing.assert_close(torch.tensor(q_probs), expected.probs, atol=1e-5, rtol=0)

    # keep_length rides on the call: keep x_1, append another token, draft 2.
    again = propose(stub, sid, 2, keep=n + 1, append=[17])
    assert [d.length for d in again] == [n + 3, n + 4]
    if params.greedy:
        assert [d.token_id for d in again] == greedy_reference(DRAFT_MODEL, prompt + ids[:1] + [17], 2)
    assert rollback(stub, sid, n) == n
    assert rollback(stub, sid, n) == n  # to the current length: a no-op
    assert close(stub, sid) is True


@pytest.mark.parametrize("name", SAMPLINGS)
def test_target_round_trip(target, name):
    _, stub, _ = target
    sampling = SAMPLINGS[name]
    params = SamplingParams.from_wire(sampling.get("temperature", 0), sampling.get("top_k", 0),
                                      sampling.get("top_p", 0))
    prompt = tokens(11, seed=2)
    drafts = [5, 66, 7, 90]
    sid = open_session(stub, prompt, seed=3, **sampling).session_id
    n = len(prompt)
    q = [] if params.greedy else [spread_q(x) for x in drafts]
    result = verify(stub, item(sid, drafts, q))[0]
    assert not result.HasField("error") and result.length == n + 4 and result.session_id == sid
    logits = reference_logits(TARGET_MODEL, prompt + drafts)[n - 1 :]  # [k+1, V]: p_1..p_5
    if params.greedy:
        assert list(result.argmax_token_ids) == logits.argmax(-1).tolist()
        assert not result.target_probs and not result.recovery_token_ids
    else:
        assert not result.argmax_token_ids
        p = logits_to_probs(logits, params)
        expected = p[torch.arange(4), torch.tensor(drafts)]
        torch.testing.assert_close(torch.tensor(list(result.target_probs)), expected, atol=1e-5, rtol=0)
        assert len(result.recovery_token_ids) == 4
        for i, r in enumerate(result.recovery_token_ids):
            assert p[i, r] > 0, "a recovered token must be possible under p"
        assert p[4, result.bonus_token_id] > 0

    # keep_length rides on Verify: keep x_1 and x_2, append a token, 2 new drafts.
    again = verify(stub, item(sid, [8, 9], [] if params.greedy else [spread_q(8), spread_q(9)],
                              keep=n + 2, append=[44]))[0]
    assert again.length == n + 5
    if params.greedy:
        seq = prompt + drafts[:2] + [44, 8, 9]
        assert list(again.argmax_token_ids) == reference_logits(TARGET_MODEL, seq)[-3:].argmax(-1).tolist()
    assert rollback(stub, sid, n) == n
    assert close(stub, sid) is True


def test_decode_equals_target_only_greedy_decoding(target):
    _, stub, _ = target
    prompt = tokens(7, seed=4)
    sid = open_session(stub, prompt, max_new_tokens=40).session_id
    ref = greedy_reference(TARGET_MODEL, prompt, 30)
    out = decode(stub, sid, 30)
    assert list(out.token_ids) == ref
    assert out.length == len(prompt) + 29  # the last token is returned, not appended
    # Continue from a rolled-back point, appending the model's own choice.
    out2 = decode(stub, sid, 5, keep=len(prompt) + 10, append=[ref[10]])
    assert list(out2.token_ids) == ref[11:16]
    close(stub, sid)


def test_model_info(target, draft):
    t = target[1].GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=T).info
    d = draft[1].GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=T).info
    assert t.vocab_size == d.vocab_size == V and t.backend == d.backend == "model"
    assert t.max_draft_tokens == SessionLimits().max_draft_tokens and t.kv_bytes_per_token > 0


# -------------------------------------------------------------- 2. batching


BATCH_SPECS = [  # (prompt length, k, sampling, seed)
    (5, 4, GREEDY, 0),
    (37, 1, dict(temperature=0.7), 11),
    (120, 6, dict(temperature=0.9, top_k=20), 12),
    (60, 0, GREEDY, 0),
    (80, 3, dict(temperature=0.7, top_p=0.9), 13),
    (9, 2, dict(temperature=0.7), 14),
]


def _batch_items(sids, round_no):
    items = []
    for j, (sid, (n, k, sampling, _)) in enumerate(zip(sids, BATCH_SPECS)):
        k = max(k - round_no, 0)
        drafts = tokens(k, seed=100 * round_no + j)
        q = [spread_q(x) for x in drafts] if sampling.get("temperature") else []
        # Round 1 rejects the last draft of round 0 and appends a recovery-like token.
        keep = None if round_no == 0 else n + max(BATCH_SPECS[j][1] - 1, 0)
        items.append(item(sid, drafts, q, keep=keep, append=[] if round_no == 0 else [3 + j]))
    return items


def test_batched_verify_equals_verifying_each_alone(target):
    _, stub, _ = target
    batched = [open_session(stub, tokens(n, seed=n), seed=s, **sp).session_id for n, _, sp, s in BATCH_SPECS]
    alone = [open_session(stub, tokens(n, seed=n), seed=s, **sp).session_id for n, _, sp, s in BATCH_SPECS]
    for round_no in (0, 1):
        response = stub.Verify(target_pb2.VerifyRequest(items=_batch_items(batched, round_no)), timeout=T)
        assert response.batch_size == len(BATCH_SPECS)
        solo = [verify(stub, it)[0] for it in _batch_items(alone, round_no)]
        for b, s, b_sid, s_sid in zip(response.results, solo, batched, alone):
            assert (b.session_id, s.session_id) == (b_sid, s_sid)
            s.session_id = b_sid
            assert_same_verify(b, s)
    for sid in batched + alone:
        close(stub, sid)


# ---------------------------------------------------------------- 3. health


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_health_is_not_serving_while_loading(role):
    release = threading.Event()
    engine = tiny_engine(model=TARGET_MODEL)
    limits = SessionLimits()

    def build_backend():
        assert release.wait(30), "never released"
        return Verifier(engine) if role == "target" else ModelDrafter(engine)

    port = _free_port()
    cfg = local_config()
    cfg.port = port
    if role == "target":
        start = start_target_service(cfg, limits, build_backend)
        name, stub_cls = TARGET_SERVICE, target_pb2_grpc.TargetServiceStub
    else:
        start = start_draft_service(cfg, limits, build_backend)
        name, stub_cls = DRAFT_SERVICE, draft_pb2_grpc.DraftServiceStub
    loop = BackgroundLoop()
    starting = asyncio.run_coroutine_threadsafe(start, loop.loop)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = stub_cls(channel)
        deadline = time.monotonic() + 10
        while True:  # wait for the bind
            try:
                status = health_status(port, "")
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_status(port, name) == health_pb2.HealthCheckResponse.NOT_SERVING
        expect_status(Code.UNAVAILABLE, "loading", open_session, stub, [1, 2, 3])
        expect_status(Code.UNAVAILABLE, "loading", stub.GetModelInfo, common_pb2.GetModelInfoRequest(), timeout=T)
        if role == "target":
            expect_status(Code.UNAVAILABLE, "loading", verify, stub, item("x", [1]))
        else:
            expect_status(Code.UNAVAILABLE, "loading", propose, stub, "x", 2)
        assert not starting.done()
        release.set()
        service = starting.result(30)
        for service_name in ("", name):
            assert health_status(port, service_name) == health_pb2.HealthCheckResponse.SERVING
        assert open_session(stub, [1, 2, 3]).length == 3
        loop.run(service.stop(0))
    finally:
        release.set()
        channel.close()
        loop.close()


def test_drain_lets_in_flight_decode_finish_and_refuses_new_calls():
    engine = tiny_engine(model=TARGET_MODEL)
    with running_target(engine) as (service, stub, loop):
        sid = open_session(stub, [5, 6, 7], max_new_tokens=600).session_id
        port = service.port
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=TARGET_SERVICE),
                                                          timeout=T)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        # Hold the engine thread, so the Decode is surely in flight when the drain starts.
        gate = threading.Event()
        blocker = asyncio.run_coroutine_threadsafe(service.worker.run(gate.wait, 10), loop.loop)
        in_flight = stub.Decode.future(target_pb2.DecodeRequest(session_id=sid, num_tokens=500), timeout=T)
        # The Decode is in flight once its job is queued behind the blocker
        # (on a loaded machine that can take a while: wait for it, not a fixed time).
        deadline = time.monotonic() + T
        while service.worker.pending < 2 and not in_flight.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.worker.pending == 2 and not in_flight.done()
        draining = asyncio.run_coroutine_threadsafe(service.running.drain(8.0), loop.loop)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        time.sleep(0.2)
        expect_status(Code.UNAVAILABLE, "", open_session, stub, [1, 2])  # new calls are refused
        started = time.monotonic()
        gate.set()
        blocker.result(T)
        out = in_flight.result(T)
        assert len(out.token_ids) == 500 and out.length == 3 + 499
        draining.result(T)
        assert time.monotonic() - started < 8.0
        expect_status(Code.UNAVAILABLE, "", open_session, stub, [1, 2])
        channel.close()


# -------------------------------------------------------------- 4. sessions


def test_session_ids_are_unguessable(target, draft):
    for stub in (target[1], draft[1]):
        ids = [open_session(stub, [1, 2]).session_id for _ in range(20)]
        assert len(set(ids)) == 20
        assert all(len(sid) >= 22 for sid in ids)  # >= 128 random bits, url-safe base64
        assert len(set("".join(ids))) > 40  # not a counter
        for sid in ids:
            close(stub, sid)


def test_closing_twice_is_harmless(target, draft, untouched):
    for stub in (target[1], draft[1]):
        sid = open_session(stub, [1, 2, 3]).session_id
        assert close(stub, sid) is True
        assert close(stub, sid) is False
        expect_status(Code.NOT_FOUND, "unknown or expired", rollback, stub, sid, 1)


@pytest.fixture(scope="module")
def short_ttl():
    limits = SessionLimits(session_ttl_s=0.3)
    t_engine, d_engine = tiny_engine(model=TARGET_MODEL), tiny_engine(model=DRAFT_MODEL)
    with running_target(t_engine, limits) as t, running_draft(d_engine, limits) as d:
        yield t_engine, t[1], d_engine, d[1]


def _wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_idle_session_expires_and_frees_its_kv(short_ttl):
    t_engine, t_stub, d_engine, d_stub = short_ttl
    idle = open_session(t_stub, tokens(20, seed=5), max_new_tokens=100).session_id
    busy = open_session(t_stub, tokens(20, seed=6)).session_id
    d_idle = open_session(d_stub, tokens(20, seed=5)).session_id
    assert t_engine.num_sessions == 2 and t_engine.kv_bytes_reserved > 0 and d_engine.num_sessions == 1
    kv_busy = t_engine.slot_bytes
    for _ in range(12):  # a session in use does not expire; the idle ones do (reaped every 0.075 s)
        assert rollback(t_stub, busy, 20) == 20
        time.sleep(0.08)
    assert rollback(t_stub, busy, 20) == 20
    assert t_engine.num_sessions == 1 and d_engine.num_sessions == 0
    assert t_engine.kv_bytes_reserved == kv_busy
    expect_status(Code.NOT_FOUND, "unknown or expired", rollback, t_stub, idle, 1)
    expect_status(Code.NOT_FOUND, "unknown or expired", propose, d_stub, d_idle, 2)
    close(t_stub, busy)


def test_max_sessions_is_resource_exhausted():
    for role in ("target", "draft"):
        engine = tiny_engine(model=TARGET_MODEL, max_sessions=2)
        running = running_target(engine) if role == "target" else running_draft(engine)
        with running as (_, stub, _):
            first = open_session(stub, [1, 2]).session_id
            open_session(stub, [3, 4])
            expect_status(Code.RESOURCE_EXHAUSTED, "too many open sessions", open_session, stub, [5])
            close(stub, first)
            assert open_session(stub, [5]).length == 1


# ------------------------------------------------------------ 5. bad input


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
    _wait_until(lambda: t_engine.num_sessions == 0 and d_engine.num_sessions == 0)
    live = open_session(t_stub, [4, 5, 6]).session_id
    expect_status(Code.NOT_FOUND, "unknown or expired", rollback, t_stub, t_sid, 1)
    expect_status(Code.NOT_FOUND, "unknown or expired", decode, t_stub, t_sid, 1)
    expect_status(Code.NOT_FOUND, "unknown or expired", propose, d_stub, d_sid, 1)
    expect_status(Code.NOT_FOUND, "unknown or expired", rollback, d_stub, d_sid, 1)
    results = verify(t_stub, item(t_sid, [1]), item(live, [1]))
    assert results[0].error.code == NOT_FOUND and "expired" in results[0].error.message
    assert not results[1].HasField("error") and len(results[1].argmax_token_ids) == 2
    assert close(t_stub, t_sid) is False and close(d_stub, d_sid) is False
    close(t_stub, live)


# ---------------------------------------------------------------- 6. fuzzing

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


# ------------------------------------------------------- 7. n-gram drafter


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
