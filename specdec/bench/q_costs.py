"""What a sampled round's proposals q cost each role, in either wire
encoding (`specd overhead --wire`; specdec/sampling/q_wire.py).

Per encoding (the lists, packed) and per number of sessions in a Verify, in
this process and on the CPU, microseconds:

- the draft: its ProposeAll reply of k drafts built and serialized
  (the service's own `drafts_to_wire`);
- the orchestrator: that reply parsed, the Verify item made of it with the
  q's passed on, q_i(x_i) read for the accept test, the Verify serialized;
- the target: the Verify parsed and every q checked (`Verifier.verify`'s
  `q_checks.check_items`), warm (back to back) and as a round meets it (a tiny
  model's forward pass between two checks, so the caches are cold).

The q's are truncated drafts of 32 entries over Qwen's vocabulary (151936),
as the draft sends them by default.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from specdec.bench.wire import QWEN_VOCAB, table

ENCODINGS = ("lists", "packed")


@dataclass(frozen=True)
class _Draft:  # what the draft service's `draft_to_wire` reads of a drafted token
    index: int
    token_id: int
    length: int
    confidence: float
    q: object


@dataclass
class QCosts:
    encoding: str
    sessions: int
    draft_us: float  # per session
    orchestrator_us: float  # per session
    target_warm_us: float  # the whole Verify
    target_cold_us: float


def _drafts(rng: random.Random, k: int, entries: int) -> list[_Draft]:
    from specdec.sampling.sparse import SparseDist

    out = []
    for i in range(k):
        ids = rng.sample(range(QWEN_VOCAB), entries)
        weights = torch.tensor([rng.random() ** 4 for _ in range(entries)], dtype=torch.float64)
        probs = (weights / weights.sum()).float()
        out.append(_Draft(i, ids[0], 100 + i, float(probs[0]), SparseDist(torch.tensor(ids), probs)))
    return out


def _best_us(fn, reps: int) -> float:
    """Microseconds a call, the fastest of five runs of `reps` calls (warm)."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


def measure(k: int = 4, entries: int = 32, sessions: tuple[int, ...] = (1, 8), reps: int = 1000) -> list[QCosts]:
    from draft_service.servicer import drafts_to_wire
    from specdec.bench.overhead_stack import tiny_engine
    from specdec.sampling import q_checks, q_wire
    from specdec.v1 import draft_pb2, target_pb2

    rng = random.Random(3)
    engine = tiny_engine(seed=0)  # its forward pass leaves the caches as a round's does
    context = engine.open_session([rng.randrange(3, 128) for _ in range(48)])
    drafts = _drafts(rng, k, entries)
    rows = []
    for encoding in ENCODINGS:
        packed = encoding == "packed"

        def draft_reply() -> bytes:
            return drafts_to_wire([(d, 1e-3) for d in drafts], packed).SerializeToString()

        reply = draft_reply()

        def orchestrator(session: str = "s") -> target_pb2.VerifyItem:
            received = list(draft_pb2.ProposeAllResponse.FromString(reply).drafts)
            item = target_pb2.VerifyItem(session_id=session, keep_length=100,
                                         draft_token_ids=[d.token_id for d in received])
            item.draft_q.extend(d.q for d in received)
            [q_wire.prob_of(d.q, d.token_id) for d in received]
            return item

        def verify_bytes(n: int) -> bytes:
            return target_pb2.VerifyRequest(items=[orchestrator(f"s{i}") for i in range(n)]).SerializeToString()

        draft_us, orchestrator_us = _best_us(draft_reply, reps), _best_us(lambda: verify_bytes(1), reps)
        for n in sessions:
            wire = verify_bytes(n)

            def target() -> None:
                request = target_pb2.VerifyRequest.FromString(wire)
                checked = q_checks.check_items([([q_wire.received(q) for q in it.draft_q], list(it.draft_token_ids))
                                              for it in request.items], QWEN_VOCAB)
                assert not any(isinstance(c, ValueError) for c in checked), checked

            cold = []
            for _ in range(max(reps // 10, 50)):
                _forward(engine, context)
                start = time.perf_counter()
                target()
                cold.append(time.perf_counter() - start)
            rows.append(QCosts(encoding, n, draft_us, orchestrator_us, _best_us(target, max(reps // n, 50)),
                               statistics.median(cold) * 1e6))
    return rows


def _forward(engine, session) -> None:
    """One decode step of `session` and back (the context stays as it was)."""
    from specdec.engine.engine import ExtendItem

    length = session.length
    engine.extend([ExtendItem(session.id, length, [5], num_logits=1)])
    engine.rollback(session.id, length)


def report(rows: list[QCosts], k: int = 4, entries: int = 32) -> str:
    body = [[r.encoding, str(r.sessions), f"{r.draft_us * r.sessions:.1f}", f"{r.orchestrator_us * r.sessions:.1f}",
             f"{r.target_warm_us:.1f}", f"{r.target_cold_us:.1f}"] for r in rows]
    return (f"A sampled round's q's in each encoding: CPU per Verify (k={k}, {entries} entries per q; "
            "the draft's and the orchestrator's part per session, times the sessions), microseconds\n\n"
            + table(["q encoding", "sessions", "draft: replies built", "orchestrator: q's passed on, q(x) read",
                      "target: q's checked, warm", "target: the same after a forward pass"], body))
