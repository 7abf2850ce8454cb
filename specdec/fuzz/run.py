"""Drive the fuzzers with hypothesis until a service has been sent N messages,
with a witness running beside them; used by `python -m specdec.fuzz` and by
tests/test_fuzz_services.py (strict: the first violation fails the example,
and hypothesis reports it)."""
from __future__ import annotations

import concurrent.futures
import math
import time

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from specdec.fuzz import front_doors, programs, services
from specdec.fuzz.contract import mostly
from specdec.fuzz.oracle import CALL_TIMEOUT_S, Expect, Tally, Witness, call
from specdec.fuzz.system import FuzzSystem
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc

SERVICES = ("target", "draft", "orchestrator", "http", "ngram")
OVERSIZE = 17 << 20  # bytes: above the servers' 16 MiB message limit
W_PROMPT = [40, 41, 42, 43, 40, 41, 42]  # repeats itself, so prompt lookup drafts too


def drive(strategy, body, examples: int, seed: int) -> None:
    """Run `body` on `examples` values drawn from `strategy`. No shrinking:
    each step of it replays calls against live servers, and minutes of it
    gain little over the failing program as drawn, which is reported."""
    phases = (Phase.generate,)

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(strategy)
    def run(value):
        body(value)

    run()


def until(tally: Tally, service: str, messages: int, strategy, body, seed: int) -> None:
    """Rounds of `drive` until `messages` messages were sent to `service`."""
    examples_done, round_no = 0, 0
    while tally.sent(service) < messages:
        sent = tally.sent(service)
        per_example = sent / examples_done if examples_done else 8.0
        examples = max(1, min(500, math.ceil((messages - sent) / max(per_example, 1.0))))
        drive(strategy, body, examples, seed + round_no)
        examples_done += examples
        round_no += 1


# ------------------------------------------------------------- witnesses

def target_witness(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = target_pb2_grpc.TargetServiceStub(channel)

    def run():
        greedy = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=W_PROMPT), timeout=CALL_TIMEOUT_S)
        sampled = stub.OpenSession(common_pb2.OpenSessionRequest(
            prompt_token_ids=W_PROMPT, seed=99, sampling=common_pb2.SamplingParams(temperature=0.8)),
            timeout=CALL_TIMEOUT_S)
        try:
            decoded = list(stub.Decode(target_pb2.DecodeRequest(session_id=greedy.session_id, num_tokens=12),
                                       timeout=CALL_TIMEOUT_S).token_ids)
            drafts = decoded[5:9]
            items = [target_pb2.VerifyItem(session_id=greedy.session_id, keep_length=len(W_PROMPT) + 4,
                                           append_token_ids=[decoded[4]], draft_token_ids=drafts),
                     target_pb2.VerifyItem(session_id=sampled.session_id, draft_token_ids=drafts,
                                           draft_q=[common_pb2.SparseDistribution(token_ids=[x], probs=[1.0])
                                                    for x in drafts])]
            a, b = stub.Verify(target_pb2.VerifyRequest(items=items), timeout=CALL_TIMEOUT_S).results
            return decoded, list(a.argmax_token_ids), list(b.recovery_token_ids), b.bonus_token_id
        finally:
            for sid in (greedy.session_id, sampled.session_id):
                stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)

    return run, channel


def draft_witness(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = draft_pb2_grpc.DraftServiceStub(channel)

    def propose(sid, k, **kw):
        replies = stub.Propose(draft_pb2.ProposeRequest(session_id=sid, num_draft_tokens=k, **kw),
                               timeout=CALL_TIMEOUT_S)
        return [(r.token_id, r.length, tuple(r.q.token_ids)) for r in replies]

    def run():
        greedy = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=W_PROMPT), timeout=CALL_TIMEOUT_S)
        sampled = stub.OpenSession(common_pb2.OpenSessionRequest(
            prompt_token_ids=W_PROMPT, seed=7, sampling=common_pb2.SamplingParams(temperature=0.8, top_k=20)),
            timeout=CALL_TIMEOUT_S)
        try:
            first = propose(greedy.session_id, 4)
            second = propose(greedy.session_id, 4, keep_length=len(W_PROMPT) + 2, append_token_ids=[first[0][0]])
            return first, second, propose(sampled.session_id, 6)
        finally:
            for sid in (greedy.session_id, sampled.session_id):
                stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)

    return run, channel


def orchestrator_witness(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
    return (lambda: [front_doors.generate_tokens(stub, req) for req in front_doors.witness_requests()]), channel


# ------------------------------------------------------------- services

def _oversize(tally: Tally, channel, path: str, service: str, streaming: bool) -> None:
    """One message above the size limit: RESOURCE_EXHAUSTED, never a crash."""
    data = b"\x0a" + _varint(OVERSIZE) + b"\x05" * OVERSIZE
    method = (channel.unary_stream if streaming else channel.unary_unary)(
        path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    out = call(method, data, streaming=streaming)
    tally.check(service, "raw:oversize", out, Expect.FAIL, f"{len(data)} bytes")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def fuzz_service(system: FuzzSystem, service: str, messages: int, tally: Tally, seed: int = 0) -> dict:
    """Send at least `messages` fuzzed messages to one service; returns what
    the witness saw. Violations land in `tally`."""
    start = time.monotonic()
    if service in ("target", "draft", "ngram"):
        port = {"target": system.target_port, "draft": system.draft_port, "ngram": system.ngram_port}[service]
        make = target_witness if service == "target" else draft_witness
        fuzzer = services.ServiceFuzzer(service, port, tally, system.max_draft_tokens)
        strategy, body = programs.program(service, system.max_draft_tokens), fuzzer.run
        name = "TargetService/OpenSession" if service == "target" else "DraftService/OpenSession"
        _oversize(tally, fuzzer.channel, f"/specdec.v1.{name}", service, False)
    elif service == "orchestrator":
        port, make = system.orchestrator_port, orchestrator_witness
        fuzzer = front_doors.GenerateFuzzer(port, tally, system.tokenizer, system.max_draft_tokens)
        strategy, body = _generate_examples(system.max_draft_tokens), _send_at_once(fuzzer)
        _oversize(tally, fuzzer.channel, "/specdec.v1.OrchestratorService/Generate", service, True)
    elif service == "http":
        port, make = system.orchestrator_port, orchestrator_witness
        fuzzer = front_doors.HttpFuzzer(system.http_port, tally)
        strategy = st.lists(front_doors.http_body(), min_size=1, max_size=3)
        body = lambda bodies: [fuzzer.send(*b) for b in bodies]
    else:
        raise ValueError(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}")
    run, channel = make(port)
    witness = Witness(service, run, tally, pause_s=0.3 if service in ("orchestrator", "http") else 0.05)
    try:
        witness.start()
        until(tally, service, messages, strategy, body, seed)
    finally:
        witness.stop()
        fuzzer.close()
        channel.close()
    _check_no_leaks(system, service, tally)
    return {"service": service, "messages": tally.sent(service), "witness_runs": witness.runs,
            "witness_mismatches": len(witness.mismatches), "seconds": round(time.monotonic() - start, 1)}


def _check_no_leaks(system: FuzzSystem, service: str, tally: Tally, wait_s: float = 10.0) -> None:
    """Every session the fuzzing opened is closed again: by the fuzzer, or by
    the orchestrator when a request ends (in the background, hence the wait)."""
    deadline = time.monotonic() + wait_s
    while any(system.open_sessions().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {role: n for role, n in system.open_sessions().items() if n}
    if left:
        strict, tally.strict = tally.strict, False
        tally.violate(service, "sessions", f"sessions left open after the fuzzing: {left}")
        tally.strict = strict


def _generate_examples(limit: int):
    one = mostly(front_doors.generate_requests(limit).map(lambda r: ("gen", r)),
                  st.binary(max_size=64).map(lambda b: ("raw", b)), 8)
    return st.lists(one, min_size=1, max_size=4)


def _send_at_once(fuzzer: front_doors.GenerateFuzzer):
    """An example's requests go out together, so the orchestrator batches them."""
    pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="fuzz-generate")
    close = fuzzer.close

    def send(batch):
        jobs = [pool.submit(fuzzer.send if kind == "gen" else fuzzer.raw, value) for kind, value in batch]
        for job in jobs:
            job.result()

    def close_all():
        pool.shutdown(wait=True)
        close()

    fuzzer.close = close_all
    return send
