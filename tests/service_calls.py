"""What the service tests share (tests/test_services*.py, test_ngram_drafter.py):
tiny peaked random models, one call helper per RPC, and module fixtures for a
draft+target pair with a reference session on each, whose results every bad
call is bracketed by (`untouched`): they must stay exactly what they were.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.session_limits import SessionLimits
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from tests.conftest import TINY_VOCAB, tiny_engine, tiny_model
from tests.harness import running_draft, running_target

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


SHORT_TTL_S = 2.0  # the short_ttl services' session lifetime (their reaper runs every SHORT_TTL_S / 4)


@pytest.fixture(scope="module")
def short_ttl():
    """A target and a draft whose idle sessions expire after SHORT_TTL_S:
    long enough that a test's pauses under CPU load (a 2-core CI VM running
    several test files at once) never expire a session it still uses; tests
    wait for the expiries themselves (up to ~20 s) instead of timing them."""
    limits = SessionLimits(session_ttl_s=SHORT_TTL_S)
    t_engine, d_engine = tiny_engine(model=TARGET_MODEL), tiny_engine(model=DRAFT_MODEL)
    with running_target(t_engine, limits) as t, running_draft(d_engine, limits) as d:
        yield t_engine, t[1], d_engine, d[1]

