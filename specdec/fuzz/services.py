"""Fuzzing the draft and target services: run the programs of `programs`
(calls on a few sessions), then close what is open.

A client-side model of each session (`Sim`, session_sim.py: its length and
whether it is greedy) predicts from the contract whether a call must succeed
or must be refused (`Expect`), and what a success must look like (counts,
lengths, ids in the usable vocabulary).
"""
from __future__ import annotations

import concurrent.futures
import secrets
import zlib

import grpc

from specdec.fuzz.oracle import CALL_TIMEOUT_S, Expect, Tally, call, call_on_lane, call_on_stream, raw_on_lane
from specdec.fuzz.programs import SLOTS
from specdec.fuzz.session_sim import Sim, SimSession, cut_and_append, ids_ok, sampling_valid
from specdec.fuzz.system import MAX_CONTEXT, ROWS, USABLE_VOCAB
from specdec.rpc import lane_methods
from specdec.rpc.grpc_errors import status_from_number
from specdec.sampling import q_wire
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

MAX_VERIFY_BATCH = 64

# ------------------------------------------------------------------ driver


class ServiceFuzzer:
    """Runs programs against one service on `port`: "target", "draft" (a
    model drafter) or "ngram" (the prompt-lookup drafter: no tokenizer, so
    every row is a usable id, and it may draft fewer than k tokens)."""

    def __init__(self, service: str, port: int, tally: Tally, limit: int):
        self.service = service
        self.tally = tally
        self.limit = limit
        self.usable = ROWS if service == "ngram" else USABLE_VOCAB
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub_cls = target_pb2_grpc.TargetServiceStub if service == "target" else draft_pb2_grpc.DraftServiceStub
        self.stub = stub_cls(self.channel)
        # The service's lane (specdec/rpc/lane.py): a third of the round calls go there.
        self.lane_port = self.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S).info.lane_port
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix=f"fuzz-{service}")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.channel.close()

    # one example ---------------------------------------------------------

    def run(self, prog) -> None:
        prompt, seed, calls = prog
        sim = Sim(self.limit)
        ids: dict[str, str] = {"@unknown": "nope-" + secrets.token_urlsafe(8)}
        slots: list[str] = []
        for sampling in (common_pb2.SamplingParams(), common_pb2.SamplingParams(temperature=0.8, top_k=40)):
            sid = self._open(sim, common_pb2.OpenSessionRequest(prompt_token_ids=prompt, sampling=sampling, seed=seed))
            slots.append(sid)
        gone = self._open(sim, common_pb2.OpenSessionRequest(prompt_token_ids=[1]))
        self._close(sim, gone)
        ids["@closed"] = gone
        try:
            for op, payload in calls:
                self._one(sim, slots, ids, op, payload)
        finally:
            for sid in list(sim.open):
                self._close(sim, sid)

    def _resolve(self, symbol: str, slots: list[str], ids: dict) -> str:
        if symbol in SLOTS:
            i = SLOTS.index(symbol)
            return slots[i] if i < len(slots) else ids["@unknown"]
        return ids.get(symbol, symbol)

    def _one(self, sim: Sim, slots, ids, op: str, payload) -> None:
        if op == "open":
            sid = self._open(sim, payload)
            if sid:
                slots.append(sid)
        elif op == "raw":
            self._raw(*payload)
        elif op == "concurrent":
            self._concurrent(sim, slots, ids, *payload)
        elif op == "info":
            out = call(self.stub.GetModelInfo, payload)
            if self.tally.check(self.service, "GetModelInfo", out, Expect.OK, payload):
                info = out.response.info
                if (info.vocab_size, info.usable_vocab_size, info.max_context, info.max_draft_tokens) != \
                        (ROWS, self.usable, MAX_CONTEXT, self.limit):
                    self.tally.violate(self.service, "GetModelInfo", f"unexpected info {info}")
        else:
            msg = self._resolved(op, payload, slots, ids)
            self._send(sim, op, msg)

    def _resolved(self, op: str, payload, slots, ids):
        if op == "verify":
            msg, q_valid = payload
            msg = _copy(msg)
            for it in msg.items:
                it.session_id = self._resolve(it.session_id, slots, ids)
            return msg, q_valid
        msg = _copy(payload)
        msg.session_id = self._resolve(msg.session_id, slots, ids)
        return msg

    # calls ----------------------------------------------------------------

    def _open(self, sim: Sim, req) -> str | None:
        prompt = list(req.prompt_token_ids)
        valid = (prompt and ids_ok(prompt, self.usable) and req.max_new_tokens >= 0 and
                 len(prompt) + req.max_new_tokens <= MAX_CONTEXT and sampling_valid(req.sampling))
        out = call(self.stub.OpenSession, req)
        if not self.tally.check(self.service, "OpenSession", out, Expect.OK if valid else Expect.FAIL, req):
            return None
        sid = out.response.session_id
        if out.response.length != len(prompt):
            self.tally.violate(self.service, "OpenSession", f"length {out.response.length} != {len(prompt)}", req)
        sim.open[sid] = SimSession(len(prompt), req.sampling.temperature == 0)
        return sid

    def _close(self, sim: Sim, sid: str) -> None:
        req = common_pb2.CloseSessionRequest(session_id=sid)
        out = call(self.stub.CloseSession, req)
        if self.tally.check(self.service, "CloseSession", out, Expect.OK, req):
            if out.response.closed != (sid in sim.open):
                self.tally.violate(self.service, "CloseSession", f"closed={out.response.closed}", req)
        sim.open.pop(sid, None)

    def _send(self, sim: Sim, op: str, msg, concurrent: bool = False) -> None:
        if op == "close":
            if concurrent:
                raise AssertionError("close is not sent concurrently")
            self._close(sim, msg.session_id)
        elif op == "rollback":
            self._rollback(sim, msg, concurrent)
        elif op in ("propose", "propose_all"):
            self._propose(sim, msg, op == "propose_all", concurrent)
        elif op == "verify":
            self._verify(sim, *msg, concurrent=concurrent)
        elif op == "decode":
            self._decode(sim, msg, concurrent)

    def _rollback(self, sim: Sim, req, concurrent: bool) -> None:
        session = sim.open.get(req.session_id)
        if session is None:
            expect = Expect.FAIL
        elif session.length is None or concurrent:  # another call may change the length first
            expect = Expect.ANY
        else:
            expect = Expect.OK if 1 <= req.length <= session.length else Expect.FAIL
        out = call(self.stub.Rollback, req)
        if self.tally.check(self.service, "Rollback", out, expect, req) and not concurrent and session is not None:
            if out.response.length != req.length:
                self.tally.violate(self.service, "Rollback", f"length {out.response.length} != {req.length}", req)
            session.length = req.length

    def _propose(self, sim: Sim, req, all_at_once: bool, concurrent: bool) -> None:
        session = sim.open.get(req.session_id)
        keep = req.keep_length if req.HasField("keep_length") else None
        k = req.num_draft_tokens
        expect, new = cut_and_append(session, keep, list(req.append_token_ids), max(k, 0), 1, self.usable)
        if not 1 <= k <= self.limit:
            expect = Expect.FAIL
        if concurrent:  # another call may change the length first
            expect = Expect.ANY
        if all_at_once:
            wrapped = draft_pb2.ProposeAllRequest(propose=req)
            carrier = _carrier(wrapped)
            if carrier == "stream":
                out = call_on_stream(self.stub.ProposeAllStream, draft_pb2.ProposeAllCall, wrapped)
                rpc = "ProposeAllStream"
            elif carrier == "lane":
                out = call_on_lane(self.lane_port, lane_methods.DRAFT, wrapped)
                rpc = "ProposeAllLane"
            else:
                out, rpc = call(self.stub.ProposeAll, wrapped), "ProposeAll"
            drafts = list(out.response.drafts) if out.ok else None
        else:
            out = call(self.stub.Propose, req, streaming=True)
            rpc, drafts = "Propose", out.response
        if not self.tally.check(self.service, rpc, out, expect, req) or session is None:
            return
        if not all(0 <= d.token_id < self.usable for d in drafts):
            self.tally.violate(self.service, rpc, "a drafted token outside the usable vocabulary", req)
        if concurrent or expect is not Expect.OK:
            session.length = None
            return
        made = len(drafts) if self.service == "ngram" else k  # prompt lookup may find fewer
        if made > k or [d.length for d in drafts] != list(range(new + 1, new + made + 1)) or \
                [d.index for d in drafts] != list(range(made)):
            self.tally.violate(self.service, rpc, f"lengths {[d.length for d in drafts]} from {new}, k={k}", req)
        for d in drafts:
            if d.HasField("q") == session.greedy:
                self.tally.violate(self.service, rpc, "q sent under greedy or missing under sampling", req)
            elif d.HasField("q") and bool(d.q.packed) != req.packed_q:
                self.tally.violate(self.service, rpc, f"q not in the encoding asked for (packed: {req.packed_q})", req)
            elif d.HasField("q"):
                ids, probs = q_wire.entries(d.q)
                if d.token_id not in ids or abs(sum(probs) - 1) > 1e-3:
                    self.tally.violate(self.service, rpc, f"q does not hold its token: {d}", req)
        session.length = new + made

    def _verify(self, sim: Sim, req, q_valid: list[bool], concurrent: bool) -> None:
        call_ok = 1 <= len(req.items) <= MAX_VERIFY_BATCH
        expects, news, seen = [], [], set()
        for it, qv in zip(req.items, q_valid):
            session = sim.open.get(it.session_id)
            k = len(it.draft_token_ids)
            keep = it.keep_length if it.HasField("keep_length") else None
            expect, new = cut_and_append(session, keep, [*it.append_token_ids, *it.draft_token_ids], 0, k + 1)
            if it.session_id in seen or k > self.limit:
                expect = Expect.FAIL
            elif expect is Expect.OK and not session.greedy and not qv:
                expect = Expect.ANY
            seen.add(it.session_id)
            if concurrent:  # another call may change the length first
                expect = Expect.ANY
            expects.append(expect)
            news.append(new)
        carrier = _carrier(req)
        if carrier == "stream":
            out, rpc = call_on_stream(self.stub.VerifyStream, target_pb2.VerifyCall, req), "VerifyStream"
        elif carrier == "lane":
            out = call_on_lane(self.lane_port, lane_methods.TARGET, req)
            rpc = "VerifyLane"
        else:
            out, rpc = call(self.stub.Verify, req), "Verify"
        if not self.tally.check(self.service, rpc, out, Expect.OK if call_ok else Expect.FAIL, req) or \
                not call_ok:
            return
        results = out.response.results
        if len(results) != len(req.items):
            self.tally.violate(self.service, rpc, f"{len(results)} results for {len(req.items)} items", req)
            return
        for it, r, expect, new in zip(req.items, results, expects, news):
            self._verify_item(sim, it, r, expect, None if concurrent else new)

    def _verify_item(self, sim: Sim, it, r, expect: Expect, new: int | None) -> None:
        failed = r.HasField("error")
        code = grpc.StatusCode.OK
        if failed:
            code = status_from_number(r.error.code)
        with self.tally._lock:
            self.tally.item_counts[(self.service, code.name)] += 1
        if failed and (code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK)
                       or not r.error.message):
            self.tally.violate(self.service, "Verify.item", f"item error {r.error}", it)
        elif failed and expect is Expect.OK:
            self.tally.violate(self.service, "Verify.item", f"a valid item was refused: {r.error}", it)
        elif not failed and expect is Expect.FAIL:
            self.tally.violate(self.service, "Verify.item", "an invalid item succeeded", it)
        session = sim.open.get(it.session_id)
        if failed or session is None:
            return
        k = len(it.draft_token_ids)
        emitted = [*r.argmax_token_ids, *r.recovery_token_ids] + ([] if r.argmax_token_ids else [r.bonus_token_id])
        if not all(0 <= t < USABLE_VOCAB for t in emitted):
            self.tally.violate(self.service, "Verify.item", f"a token outside the usable vocabulary: {r}", it)
        if new is None:
            session.length = None
            return
        greedy_shape = len(r.argmax_token_ids) == k + 1 and not r.target_probs
        sampled_shape = len(r.target_probs) == len(r.recovery_token_ids) == k and not r.argmax_token_ids
        if not (greedy_shape if session.greedy else sampled_shape) or r.length != new:
            self.tally.violate(self.service, "Verify.item", f"result shape or length wrong (expected {new}): {r}", it)
        if not all(0 <= p <= 1 for p in r.target_probs):
            self.tally.violate(self.service, "Verify.item", f"p(x) outside [0, 1]: {r}", it)
        session.length = r.length

    def _decode(self, sim: Sim, req, concurrent: bool) -> None:
        session = sim.open.get(req.session_id)
        keep = req.keep_length if req.HasField("keep_length") else None
        n = req.num_tokens
        expect, new = cut_and_append(session, keep, list(req.append_token_ids), max(n - 1, 0), 1)
        if n < 1:
            expect = Expect.FAIL
        if concurrent:  # another call may change the length first
            expect = Expect.ANY
        out = call(self.stub.Decode, req)
        if not self.tally.check(self.service, "Decode", out, expect, req) or session is None:
            return
        tokens = list(out.response.token_ids)
        if not tokens or not all(0 <= t < USABLE_VOCAB for t in tokens):
            self.tally.violate(self.service, "Decode", f"tokens {tokens}", req)
        if expect is not Expect.OK:
            session.length = None
            return
        stops = set(req.stop_token_ids)
        if len(tokens) > n or (len(tokens) < n and tokens[-1] not in stops) or \
                out.response.length != new + len(tokens) - 1:
            self.tally.violate(self.service, "Decode", f"{len(tokens)} tokens, length {out.response.length}", req)
        session.length = out.response.length

    def _concurrent(self, sim: Sim, slots, ids, slot: str, group) -> None:
        """Calls on one session sent at once: no INTERNAL, no hang; then the
        session's length is learned again."""
        target = self._resolve(slot, slots, ids)
        jobs = []
        for op, payload in group:
            msg = self._resolved(op, payload, slots, ids)
            if op == "verify":
                for it in msg[0].items:
                    it.session_id = target
            else:
                msg.session_id = target
            jobs.append(self.pool.submit(self._send, sim, op, msg, True))
        for job in jobs:
            job.result()
        session = sim.open.get(target)
        if session is not None:
            self._relearn(sim, target)

    def _relearn(self, sim: Sim, sid: str) -> None:
        session = sim.open[sid]
        session.length = None
        if self.service == "target":
            req = target_pb2.DecodeRequest(session_id=sid, num_tokens=1)
            out = call(self.stub.Decode, req)
        else:
            req = draft_pb2.ProposeRequest(session_id=sid, num_draft_tokens=1)
            out = call(self.stub.Propose, req, streaming=True)
        if self.tally.check(self.service, type(req).__name__.replace("Request", ""), out, Expect.ANY, req):
            replies = [out.response] if self.service == "target" else out.response
            session.length = replies[-1].length if replies else None  # prompt lookup may draft nothing

    def _raw(self, method: str, data: bytes) -> None:
        service = "TargetService" if self.service == "target" else "DraftService"
        streaming = method in ("Propose", "ProposeAllStream", "VerifyStream")
        path = f"/specdec.v1.{service}/{method}"
        if method.endswith("Stream"):  # one message on a call stream
            raw = self.channel.stream_stream(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            data_or_stream = iter([data])
        else:
            raw = (self.channel.unary_stream if streaming else self.channel.unary_unary)(
                path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            data_or_stream = data
        out = call(raw, data_or_stream, streaming=streaming)
        self.tally.check(self.service, f"raw:{method}", out, Expect.ANY, data)
        if method.endswith("Stream"):  # the same bytes as one frame on the lane
            lane_method = lane_methods.TARGET if self.service == "target" else lane_methods.DRAFT
            lane = raw_on_lane(self.lane_port, lane_method, data)
            self.tally.check(self.service, f"raw:{method.removesuffix('Stream')}Lane", lane, Expect.ANY, data)
        if out.ok and method == "OpenSession":  # garbage that parsed into a valid open: do not leak it
            sid = common_pb2.OpenSessionResponse.FromString(out.response).session_id
            call(self.stub.CloseSession, common_pb2.CloseSessionRequest(session_id=sid))


def _carrier(request) -> str:
    """A third of the ProposeAll and Verify calls go as unary calls, a third
    on a call stream, a third on the lane, chosen by the request's bytes (so
    a failing example replays the same way)."""
    return ("unary", "stream", "lane")[zlib.crc32(request.SerializeToString(deterministic=True)) % 3]


def _copy(msg):
    out = type(msg)()
    out.CopyFrom(msg)
    return out
