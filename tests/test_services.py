"""The draft and target services over gRPC, in-process on 127.0.0.1:0 with tiny
random models: round trips, batching, health and sessions. Bad input is
tests/test_services_bad_input.py, the fuzz test of the request fields
tests/test_services_fuzz.py, the n-gram drafter tests/test_ngram_drafter.py;
what they share is tests/service_calls.py.
"""
from __future__ import annotations

import asyncio
import math
import socket
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.drafters import ModelDrafter
from draft_service.server import SERVICE_NAME as DRAFT_SERVICE, start_draft_service
from specdec.rpc.session_limits import SessionLimits
from specdec.sampling.params import SamplingParams
from specdec.sampling.sparse import truncate
from specdec.sampling.transform import logits_to_probs
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.server import SERVICE_NAME as TARGET_SERVICE, start_target_service
from target_service.verifier import Verifier
from tests.conftest import tiny_engine
from tests.harness import BackgroundLoop, local_config, running_draft, running_target
from tests.service_calls import (
    Code,
    DRAFT_MODEL,
    GREEDY,
    T,
    TARGET_MODEL,
    V,
    assert_same_verify,
    close,
    decode,
    expect_status,
    greedy_reference,
    health_status,
    item,
    open_session,
    propose,
    reference_logits,
    rollback,
    spread_q,
    tokens,
    verify,
)
from tests.service_calls import draft, reference, short_ttl, target, untouched  # noqa: F401 - pytest fixtures, used by name


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


def test_a_session_whose_logits_have_no_finite_mass_fails_alone_in_its_verify_batch(monkeypatch):
    """NaN logits (an fp16 overflow on one context, say) fail that session's
    item, not the batch: the other sessions of the same Verify get their tokens."""
    from specdec.rpc.model_service import SessionMeta
    from target_service.verifier import VerifyRequestItem

    engine = tiny_engine()
    verifier = Verifier(engine)
    meta = SessionMeta(params=SamplingParams(0.8, 0, 1.0), seed=3)
    sids = [verifier.open(prompt, meta, 16)[0] for prompt in ([3, 4, 5], [6, 7, 8, 9])]
    extend = engine.extend

    def nan_for_the_first(items):
        logits = extend(items)
        return [torch.full_like(rows, float("nan")) if i == 0 else rows for i, rows in enumerate(logits)]

    monkeypatch.setattr(engine, "extend", nan_for_the_first)
    items = [VerifyRequestItem(session_id=sid, keep_length=None, append=[10], drafts=[], draft_q=[]) for sid in sids]
    batch = verifier.verify(items)
    assert batch.batch_size == 2
    assert "no finite mass" in str(batch.items[0].error) and batch.items[0].outcome is None
    assert batch.items[1].error is None and batch.items[1].outcome.bonus_id >= 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_health_is_not_serving_while_loading(role):
    release = threading.Event()
    engine = tiny_engine(model=TARGET_MODEL)
    # A quota of one session: an open refused while loading must not keep its reservation.
    limits = SessionLimits(max_sessions_per_caller=1)

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
        for _ in range(2):
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
        in_flight = stub.Decode.future(target_pb2.DecodeRequest(session_id=sid, num_tokens=50), timeout=T)
        # The Decode is in flight once its job is queued behind the blocker
        # (on a loaded machine that can take a while: wait for it, not a fixed time).
        deadline = time.monotonic() + T
        while service.worker.pending < 2 and not in_flight.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.worker.pending == 2 and not in_flight.done()
        # A grace far longer than the call needs: the drain waits for the call, not the grace.
        draining = asyncio.run_coroutine_threadsafe(service.running.drain(60.0), loop.loop)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        time.sleep(0.2)
        expect_status(Code.UNAVAILABLE, "", open_session, stub, [1, 2])  # new calls are refused
        gate.set()
        blocker.result(T)
        out = in_flight.result(T)
        assert len(out.token_ids) == 50 and out.length == 3 + 49  # answered whole, though the drain began first
        draining.result(T)
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


def test_idle_session_expires_and_frees_its_kv(short_ttl):
    t_engine, t_stub, d_engine, d_stub = short_ttl
    # `busy` is opened first: were its calls not to keep it alive, it would
    # be idle longer than `idle` and expire no later than it (in the same
    # reaper pass or an earlier one), so it must outlive `idle` below.
    busy = open_session(t_stub, tokens(20, seed=6)).session_id
    idle = open_session(t_stub, tokens(20, seed=5), max_new_tokens=100).session_id
    d_idle = open_session(d_stub, tokens(20, seed=5)).session_id
    assert t_engine.num_sessions == 2 and t_engine.kv_bytes_reserved > 0 and d_engine.num_sessions == 1
    kv_busy = t_engine.slot_bytes
    # A session in use does not expire; the idle ones do (after SHORT_TTL_S,
    # reaped every SHORT_TTL_S / 4): use `busy` until they have.
    deadline = time.monotonic() + 20.0
    while not (t_engine.num_sessions == 1 and d_engine.num_sessions == 0):
        assert time.monotonic() < deadline, "the idle sessions did not expire"
        assert rollback(t_stub, busy, 20) == 20
        time.sleep(0.05)
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
