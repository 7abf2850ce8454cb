"""The programs the draft and target services are fuzzed with, as hypothesis
strategies: one example opens a greedy and a sampled session, then makes 1..12
drawn calls (OpenSession, Propose/ProposeAll or Verify/Decode, Rollback,
CloseSession, GetModelInfo, a group of calls sent at once on one session, raw
bytes sent as a message). Session ids in the drawn messages are symbols
("@0": the program's first session, "@closed", "@unknown") resolved when sent
(`services.ServiceFuzzer`), or wild strings. Every value is drawn sane most of
the time (so calls get deep) and wild otherwise (`contract.mostly`).
"""
from __future__ import annotations

from hypothesis import strategies as st

from specdec.fuzz import contract
from specdec.fuzz.contract import INT32, mostly
from specdec.fuzz.system import MAX_CONTEXT, ROWS, USABLE_VOCAB
from specdec.sampling import q_wire
from specdec.sampling.sparse import SparseDist
from specdec.v1 import common_pb2, draft_pb2, target_pb2

SLOTS = ["@0", "@1", "@2", "@3"]

# ------------------------------------------------------------------ values

TOKEN = mostly(st.integers(0, USABLE_VOCAB - 1),
               st.one_of(st.integers(USABLE_VOCAB, ROWS - 1), st.integers(-3, -1), st.just(ROWS), INT32))
SANE_TOKENS = st.lists(st.integers(0, USABLE_VOCAB - 1), min_size=1, max_size=16)
HUGE = st.sampled_from([MAX_CONTEXT, MAX_CONTEXT + 1, 5000, 100_000]).map(lambda n: [7] * n)
PROMPT = mostly(SANE_TOKENS, st.one_of(st.just([]), HUGE, st.lists(TOKEN, max_size=16)))
APPEND = mostly(st.lists(st.integers(0, USABLE_VOCAB - 1), max_size=3), st.lists(TOKEN, max_size=6))
KEEP = mostly(st.none(), mostly(st.integers(0, 16), st.one_of(st.integers(-3, 300), INT32)), 2)
LENGTH = mostly(st.integers(1, 30), st.one_of(st.integers(-3, 0), st.integers(31, 300), INT32))
SAMPLING = mostly(st.builds(common_pb2.SamplingParams, temperature=st.sampled_from([0.0, 0.0, 0.5, 0.7, 1.0, 1e-6]),
                            top_k=st.sampled_from([0, 0, 5, 50, 1000]), top_p=st.sampled_from([0.0, 0.5, 0.9, 1.0])),
                  contract.message(common_pb2.SamplingParams))
SESSION = mostly(st.sampled_from(SLOTS[:2] * 3 + SLOTS[2:]), st.one_of(st.sampled_from(["@closed", "@unknown"]),
                                                                        contract.TEXT))


def k_values(limit: int) -> st.SearchStrategy:
    return mostly(st.integers(1, limit), st.one_of(st.integers(-2, 0), st.integers(limit + 1, limit + 3), INT32))


@st.composite
def draft_q(draw, drafts: list[int]) -> tuple[list, bool]:
    """(q list, whether it is valid by construction for a sampled session)."""
    kind = draw(st.integers(0, 5))
    in_range = all(0 <= x < USABLE_VOCAB for x in drafts)
    if kind <= 1 and in_range:
        return [common_pb2.SparseDistribution(token_ids=[x], probs=[1.0]) for x in drafts], True
    if kind <= 3 and in_range:  # three entries, as the lists or packed (specdec/sampling/q_wire.py)
        entries = [([x, (x + 1) % USABLE_VOCAB, (x + 7) % USABLE_VOCAB], [0.5, 0.25, 0.25]) for x in drafts]
        if kind == 2:
            return [common_pb2.SparseDistribution(packed=q_wire.pack(SparseDist.from_lists(ids, probs)))
                    for ids, probs in entries], True
        return [common_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in entries], True
    return draw(st.lists(contract.message(common_pb2.SparseDistribution,
                                          {"token_ids": st.lists(TOKEN, max_size=4)}), max_size=6)), False


@st.composite
def verify_item(draw, limit: int):
    drafts = draw(mostly(st.lists(st.integers(0, USABLE_VOCAB - 1), max_size=limit),
                         st.lists(TOKEN, max_size=limit + 3)))
    q, q_valid = draw(draft_q(drafts))
    msg = target_pb2.VerifyItem(session_id=draw(SESSION), append_token_ids=draw(APPEND), draft_token_ids=drafts,
                                draft_q=q)
    keep = draw(KEEP)
    if keep is not None:
        msg.keep_length = keep
    return msg, q_valid


def _with_keep(msg, keep):
    if keep is not None:
        msg.keep_length = keep
    return msg


def _kinds(service: str) -> list[str]:
    return ["open", "work", "work", "work", "work", "rollback", "close", "info", "raw", "concurrent"] + \
        (["decode", "decode"] if service == "target" else ["propose_all"])


CONCURRENT_KINDS = ["work", "work", "rollback", "decode", "propose_all"]


@st.composite
def one_call(draw, service: str, limit: int, kinds: tuple[str, ...] = ()):
    op = draw(st.sampled_from(list(kinds) or _kinds(service)))
    if op == "decode" and service != "target":
        op = "propose_all"
    if op == "propose_all" and service == "target":
        op = "decode"
    if op == "open":
        return op, common_pb2.OpenSessionRequest(
            prompt_token_ids=draw(PROMPT), sampling=draw(SAMPLING), seed=draw(contract.UINT64),
            max_new_tokens=draw(mostly(st.integers(0, 50), INT32)), request_id=draw(contract.TEXT))
    if op in ("work", "propose_all") and service != "target":
        req = _with_keep(draft_pb2.ProposeRequest(session_id=draw(SESSION), append_token_ids=draw(APPEND),
                                                  num_draft_tokens=draw(k_values(limit)),
                                                  packed_q=draw(st.booleans())), draw(KEEP))
        return ("propose_all" if op == "propose_all" else "propose"), req
    if op == "work":  # target: Verify
        items = draw(mostly(st.lists(verify_item(limit), min_size=1, max_size=3),
                            st.one_of(st.just([]), st.lists(verify_item(limit), min_size=4, max_size=8))))
        if draw(st.integers(0, 3)):  # one item per session, as a batching client sends them
            order = [*draw(st.permutations(SLOTS[:2])), *SLOTS[2:]]
            for (msg, _), slot in zip(items, order):
                msg.session_id = slot
        return "verify", (target_pb2.VerifyRequest(items=[m for m, _ in items]), [v for _, v in items])
    if op == "decode":
        return op, _with_keep(target_pb2.DecodeRequest(
            session_id=draw(SESSION), append_token_ids=draw(APPEND),
            num_tokens=draw(mostly(st.integers(1, 6), st.one_of(st.integers(-2, 0), st.just(MAX_CONTEXT), INT32))),
            stop_token_ids=draw(st.lists(TOKEN, max_size=3))), draw(KEEP))
    if op == "rollback":
        return op, common_pb2.RollbackRequest(session_id=draw(SESSION), length=draw(LENGTH))
    if op == "close":
        return op, common_pb2.CloseSessionRequest(session_id=draw(SESSION))
    if op == "info":
        return op, common_pb2.GetModelInfoRequest()
    if op == "raw":
        method = draw(st.sampled_from(sorted(_methods(service))))
        data = draw(st.one_of(st.binary(max_size=64), _mutated(service, method, limit)))
        return op, (method, data)
    slot = draw(st.sampled_from(SLOTS[:2]))
    group = [draw(one_call(service, limit, tuple(CONCURRENT_KINDS))) for _ in range(draw(st.integers(2, 4)))]
    return "concurrent", (slot, group)


@st.composite
def _mutated(draw, service: str, method: str, limit: int):
    """A valid message of the method, serialized, then cut, grown or bit-flipped."""
    data = bytearray(_SAMPLE[method].SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "grow"]))
        if how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif how == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)):]
        else:
            data += draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


_SAMPLE = {
    "OpenSession": common_pb2.OpenSessionRequest(prompt_token_ids=[5, 6, 300], request_id="x"),
    "Rollback": common_pb2.RollbackRequest(session_id="nope-0123456789", length=3),
    "CloseSession": common_pb2.CloseSessionRequest(session_id="nope-0123456789"),
    "GetModelInfo": common_pb2.GetModelInfoRequest(),
    "Propose": draft_pb2.ProposeRequest(session_id="nope-0123456789", keep_length=2, num_draft_tokens=3,
                                        append_token_ids=[4]),
    "ProposeAll": draft_pb2.ProposeAllRequest(propose=draft_pb2.ProposeRequest(session_id="nope-01", num_draft_tokens=2)),
    "Verify": target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(session_id="nope-0123", draft_token_ids=[1, 2],
                                                                    draft_q=[common_pb2.SparseDistribution(
                                                                        token_ids=[1], probs=[1.0])])]),
    "Decode": target_pb2.DecodeRequest(session_id="nope-0123456789", num_tokens=2, stop_token_ids=[9]),
}
_SAMPLE["ProposeAllStream"] = draft_pb2.ProposeAllCall(call_id=7, request=_SAMPLE["ProposeAll"],
                                                       trace_context={"traceparent": "00-bad"})
_SAMPLE["VerifyStream"] = target_pb2.VerifyCall(call_id=7, request=_SAMPLE["Verify"])


def _methods(service: str) -> set[str]:
    common = {"OpenSession", "Rollback", "CloseSession", "GetModelInfo"}
    return common | ({"Verify", "VerifyStream", "Decode"} if service == "target"
                     else {"Propose", "ProposeAll", "ProposeAllStream"})


@st.composite
def program(draw, service: str, limit: int):
    """(prompt, seed, calls) of one example."""
    prompt = draw(st.lists(st.integers(0, USABLE_VOCAB - 1), min_size=1, max_size=12))
    return prompt, draw(st.integers(0, 2**64 - 1)), draw(st.lists(one_call(service, limit), min_size=1, max_size=12))
