"""Bytes on the wire and Verify throughput of the services (`specd overhead --wire`).

Two Markdown tables (formerly benchmarks/service_overhead.py):

- Bytes of one steady-state round (protobuf `SerializeToString` lengths;
  HTTP/2 and gRPC framing not counted) at the Qwen vocabulary size (151936,
  so token ids take realistic varint widths), greedy and T=0.7 (q truncated
  to 32 entries per drafted token), and per emitted token at acceptance rate
  a: E = (1 - a^(k+1)) / (1 - a) tokens per round. The drafts travel as the
  Propose stream's messages (what a pipelining client receives; ProposeAll
  carries the same messages inside one).
- Verify throughput with 1, 4 and 16 sessions per call (k drafts each,
  context lengths 50-300), through the server: on the tiny target, and on a
  cached model when one is named (e.g. qwen2.5-coder-1.5b-instruct).

The T=0.7 round's bytes are given for both encodings of its q's
(specdec/sampling/q_wire.py); what each encoding costs each role in CPU is
specdec/bench/q_costs.py, which `specd overhead --wire` prints after these.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from specdec.bench.overhead_stack import DEADLINE_S, BackgroundLoop, tiny_engine

QWEN_VOCAB = 151936
BATCHES = (1, 4, 16)


class Services:
    """A target and a draft service on a background event loop, with
    blocking stubs for the caller's thread."""

    def __init__(self, target_engine, draft_engine):
        import grpc

        from draft_service.drafters import ModelDrafter
        from draft_service.server import start_draft_service
        from specdec.rpc.session_limits import SessionLimits
        from specdec.rpc.serving import ServerConfig
        from specdec.v1 import draft_pb2_grpc, target_pb2_grpc
        from target_service.server import start_target_service
        from target_service.verifier import Verifier

        limits = SessionLimits()
        self.verifier = Verifier(target_engine, limits.max_draft_tokens, limits.max_verify_batch)
        self.drafter = ModelDrafter(draft_engine, limits.max_draft_tokens)
        self.bg = BackgroundLoop()
        cfg = ServerConfig(host="127.0.0.1", port=0)
        self.target = self.bg.run(start_target_service(cfg, limits, lambda: self.verifier))
        self.draft = self.bg.run(start_draft_service(cfg, limits, lambda: self.drafter))
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in (self.target, self.draft)]
        self.target_stub = target_pb2_grpc.TargetServiceStub(self.channels[0])
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.channels[1])

    def open(self, prompt: list[int], temperature: float = 0.0, seed: int = 1) -> tuple[str, str]:
        from specdec.v1 import common_pb2

        req = common_pb2.OpenSessionRequest(prompt_token_ids=prompt, seed=seed,
                                            sampling=common_pb2.SamplingParams(temperature=temperature))
        return (self.target_stub.OpenSession(req, timeout=DEADLINE_S).session_id,
                self.draft_stub.OpenSession(req, timeout=DEADLINE_S).session_id)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for service in (self.target, self.draft):
            self.bg.run(service.stop(0))
        self.bg.stop()


def _tokens(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def expected_tokens(acceptance: float, k: int) -> float:
    return float(k + 1) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


@dataclass
class RoundBytes:
    sampling: str
    q_entries: int
    verify_request: int
    verify_reply: int
    propose_request: int
    propose_stream: int

    @property
    def total(self) -> int:
        return self.verify_request + self.verify_reply + self.propose_request + self.propose_stream


def measure_bytes(services: Services, k: int) -> list[RoundBytes]:
    """One steady-state round each way (rollback and the last emitted token
    riding on both calls), greedy and T=0.7 (its q's as lists, and packed)."""
    from specdec.sampling import q_wire
    from specdec.v1 import draft_pb2, target_pb2

    rng = random.Random(1)
    vocab = services.verifier.info.vocab_size
    rows = []
    for label, temperature, packed in (("greedy", 0.0, False), ("T=0.7, q as lists", 0.7, False),
                                       ("T=0.7, q packed", 0.7, True)):
        prompt = _tokens(200, vocab, rng)
        t_sid, d_sid = services.open(prompt, temperature, seed=rng.getrandbits(63))
        last = rng.randrange(3, vocab)  # the previous round's recovery or bonus token
        n = len(prompt) - 1
        propose = draft_pb2.ProposeRequest(session_id=d_sid, keep_length=n, append_token_ids=[last],
                                           num_draft_tokens=k, packed_q=packed)
        stream = list(services.draft_stub.Propose(propose, timeout=DEADLINE_S))
        item = target_pb2.VerifyItem(session_id=t_sid, keep_length=n, append_token_ids=[last],
                                     draft_token_ids=[d.token_id for d in stream],
                                     draft_q=[d.q for d in stream if d.HasField("q")])
        verify = target_pb2.VerifyRequest(items=[item])
        reply = services.target_stub.Verify(verify, timeout=DEADLINE_S)
        if reply.results[0].HasField("error"):
            raise RuntimeError(f"Verify failed: {reply.results[0].error}")
        rows.append(RoundBytes(label, sum(len(q_wire.entries(d.q)[0]) for d in stream), verify.ByteSize(),
                               reply.ByteSize(), propose.ByteSize(), sum(d.ByteSize() for d in stream)))
    return rows


@dataclass
class Throughput:
    target: str
    sessions: int
    call_s: float
    compute_s: float
    k: int

    @property
    def items_per_s(self) -> float:
        return self.sessions / self.call_s


def measure_throughput(services: Services, k: int, reps: int, label: str,
                       batches: tuple[int, ...] = BATCHES) -> list[Throughput]:
    """Median Verify call (and the server's reported compute) with 1, 4, 16
    greedy sessions per call, contexts 50-300."""
    from specdec.v1 import common_pb2, target_pb2

    rng = random.Random(2)
    vocab = services.verifier.info.vocab_size
    sessions = []
    for _ in range(max(batches)):
        prompt = _tokens(rng.randint(50, 300), vocab, rng)
        req = common_pb2.OpenSessionRequest(prompt_token_ids=prompt)
        sessions.append((services.target_stub.OpenSession(req, timeout=DEADLINE_S).session_id, len(prompt)))
    rows = []
    for batch in batches:
        items = [target_pb2.VerifyItem(session_id=sid, keep_length=n, draft_token_ids=_tokens(k, vocab, rng))
                 for sid, n in sessions[:batch]]
        request = target_pb2.VerifyRequest(items=items)
        services.target_stub.Verify(request, timeout=DEADLINE_S)  # warm-up
        calls, computes = [], []
        for _ in range(reps):
            start = time.perf_counter()
            reply = services.target_stub.Verify(request, timeout=DEADLINE_S)
            calls.append(time.perf_counter() - start)
            computes.append(reply.compute_micros * 1e-6)
            if reply.batch_size != batch:
                raise RuntimeError(f"Verify failed: {[r.error for r in reply.results]}")
        rows.append(Throughput(label, batch, statistics.median(calls), statistics.median(computes), k))
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def bytes_report(rows: list[RoundBytes], k: int, acceptance: float) -> str:
    expected = expected_tokens(acceptance, k)
    body = [[r.sampling, str(r.q_entries), str(r.verify_request), str(r.verify_reply), str(r.propose_request),
             str(r.propose_stream), str(r.total), f"{(r.verify_request + r.verify_reply) / expected:.0f}",
             f"**{r.total / expected:.0f}**"] for r in rows]
    return (f"Bytes per round at vocab {QWEN_VOCAB}, k={k}; per emitted token at a={acceptance} "
            f"(E = {expected:.3f} tokens/round)\n\n"
            + table(["sampling", "q entries", "Verify req", "Verify reply", "Propose req", "Propose stream",
                      "round total", "B/token (Verify only)", "B/token (round)"], body))


def throughput_report(rows: list[Throughput]) -> str:
    body = [[r.target, str(r.sessions), f"{r.call_s * 1e3:.3f}", f"{r.compute_s * 1e3:.3f}",
             f"{r.items_per_s:.3g}", f"{r.items_per_s * (r.k + 1):.3g}"] for r in rows]
    k = rows[0].k if rows else 0
    return (f"Verify throughput through the server (k={k}, contexts 50-300, greedy)\n\n"
            + table(["target", "sessions/call", "call ms", "server compute ms", "items/s", "tokens scored/s"],
                     body))


def run(k: int, acceptance: float, reps: int, target: str = "", dtype: str = "bfloat16",
        threads: int = 2) -> str:
    """Both tables; the throughput of `target` too when it is a cached model."""
    services = Services(tiny_engine(seed=0), tiny_engine(seed=1))
    try:
        throughput = measure_throughput(services, k, max(reps // 5, 20), "tiny (fp32)")
    finally:
        services.close()
    services = Services(tiny_engine(QWEN_VOCAB, seed=0, arch="qwen2"), tiny_engine(QWEN_VOCAB, seed=1, arch="qwen2"))
    try:
        sizes = measure_bytes(services, k)
    finally:
        services.close()
    if target:
        from specdec.engine.config import EngineConfig
        from specdec.engine.engine import ModelEngine
        from specdec.models.cache import resolve_model

        engine = ModelEngine.load(EngineConfig(model=str(resolve_model(target)), dtype=dtype, threads=threads,
                                               max_kv_bytes=4 << 30))
        engine.warmup()
        services = Services(engine, tiny_engine(engine.vocab_size, seed=1))
        try:
            throughput += measure_throughput(services, k, 5, f"{target} ({dtype}, {threads} threads)")
        finally:
            services.close()
    return bytes_report(sizes, k, acceptance) + "\n\n" + throughput_report(throughput)
