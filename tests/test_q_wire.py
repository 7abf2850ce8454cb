"""A draft's q on the wire in its packed encoding (specdec/sampling/q_wire.py):
the same entries, the same checks and messages as the lists, the same
Verify outcomes, and the orchestrator asks for it only from a target that
reads it."""
from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from draft_service import servicer as draft_servicer
from specdec.sampling import q_checks, q_wire
from specdec.sampling.sparse import SparseDist, validate_sparse
from specdec.sampling.sparse_lists import prob_of
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from target_service.servicer import TargetServicer
from tests.conftest import tiny_engine, tiny_model
from tests.harness import running_draft, running_system, running_target
from tests.service_calls import DRAFT_MODEL, TARGET_MODEL, T, open_session, tokens, verify

VOCAB = 1000


def check_many(qs, drafted, vocab_size):
    """One Verify item's q's through `q_checks.check_items`; its ValueError raised."""
    (checked,) = q_checks.check_items([(qs, drafted)], vocab_size)
    if isinstance(checked, ValueError):
        raise checked
    return checked


def random_q(rng: random.Random, n: int) -> tuple[list[int], list[float]]:
    ids = rng.sample(range(VOCAB), n)
    weights = torch.tensor([rng.random() + 1e-3 for _ in range(n)], dtype=torch.float64)
    return ids, (weights / weights.sum()).float().tolist()


def packed(ids, probs) -> bytes:
    return q_wire.pack(SparseDist(torch.tensor(ids, dtype=torch.int64), torch.tensor(probs, dtype=torch.float32)))


def test_packed_entries_read_back_exactly():
    rng = random.Random(0)
    for n in (1, 2, 7, 32):
        ids, probs = random_q(rng, n)
        data = packed(ids, probs)
        assert len(data) == 8 * n
        assert q_wire.unpack_lists(data) == (ids, probs)
        got_ids, got_probs = q_wire.unpack(data)
        assert got_ids.tolist() == ids and got_probs.tolist() == probs
        msg = common_pb2.SparseDistribution(packed=data)
        lists = common_pb2.SparseDistribution(token_ids=ids, probs=probs)
        for x in (ids[0], ids[-1], next(i for i in range(VOCAB) if i not in ids)):
            assert q_wire.prob_of(msg, x) == q_wire.prob_of(lists, x) == prob_of(ids, probs, x)


def test_q_of_x_read_in_place_finds_only_whole_ids_among_the_ids():
    # Ids whose bytes, side by side, spell another id straddling them; an id
    # whose bytes are a probability's; and ids out of int32's range.
    straddled = int.from_bytes(bytes([0x02, 0x00, 0x00, 0x01]), "little")  # 0x01000002
    ids = [0x00020000 + 0x100, 0x00000100, 7]  # little-endian 00 01 02 00 | 00 01 00 00 | 07 ...
    spelled = int.from_bytes(packed(ids, [0.5, 0.25, 0.25])[1:5], "little")
    probs = [0.5, 0.25, 0.25]
    data = packed(ids, probs)
    as_prob = int.from_bytes(data[12:16], "little")  # the first probability's bytes, read as an id
    for x in (*ids, spelled, straddled, as_prob, -1, 2**31, 2**40):
        assert q_wire.packed_prob_of(data, x) == prob_of(ids, probs, x), x
    negative = [-1360425750, 5]  # int32 ids, as the wire's are: a foreign writer's q may hold one
    signed = struct.pack("<2i2f", *negative, 0.75, 0.25)
    assert q_wire.packed_prob_of(signed, -1360425750) == prob_of(negative, [0.75, 0.25], -1360425750) == 0.75
    assert q_wire.packed_prob_of(data, spelled) == 0.0 and q_wire.packed_prob_of(data, as_prob) == 0.0
    rng = random.Random(1)
    for _ in range(200):
        ids, probs = random_q(rng, rng.randrange(1, 40))
        data = packed(ids, probs)
        for x in (rng.choice(ids), rng.randrange(VOCAB)):
            assert q_wire.packed_prob_of(data, x) == prob_of(ids, probs, x)


def test_writing_a_dist_fills_one_encoding():
    ids, probs = random_q(random.Random(1), 5)
    dist = SparseDist(torch.tensor(ids), torch.tensor(probs, dtype=torch.float32))
    as_lists, as_packed = common_pb2.SparseDistribution(), common_pb2.SparseDistribution()
    q_wire.write(as_lists, dist, packed=False)
    q_wire.write(as_packed, dist, packed=True)
    assert list(as_lists.token_ids) == ids and list(as_lists.probs) == probs and not as_lists.packed
    assert not as_packed.token_ids and not as_packed.probs and q_wire.unpack_lists(as_packed.packed) == (ids, probs)


def test_checked_together_as_each_alone():
    """Mixed sizes and encodings in one item: each q is the SparseDist
    validate_sparse makes of it, bit for bit."""
    rng = random.Random(2)
    for trial in range(30):
        qs, wire, drafted = [], [], []
        for _ in range(rng.randint(1, 8)):
            ids, probs = random_q(rng, rng.choice([1, 3, 32, 32]))
            x = rng.choice([i for i, p in zip(ids, probs) if p > 0])
            qs.append((ids, probs))
            wire.append(packed(ids, probs) if rng.random() < 0.7 else (ids, probs))
            drafted.append(x)
        got = check_many(wire, drafted, VOCAB)
        for dist, (ids, probs), x in zip(got, qs, drafted):
            want = validate_sparse(ids, probs, VOCAB, drafted_id=x)
            assert torch.equal(dist.token_ids, want.token_ids) and torch.equal(dist.probs, want.probs)
            assert dist.token_ids.dtype == torch.int64 and dist.probs.dtype == torch.float32


def _good() -> tuple[list[int], list[float]]:
    return [5, 9, 2, 700], [0.5, 0.25, 0.125, 0.125]


BAD = {  # name: (ids, probs, drafted)
    "negative id": ([5, -3, 2, 700], _good()[1], 5),
    "id beyond the vocabulary": ([5, 9, 2, VOCAB], _good()[1], 5),
    "duplicate id": ([5, 9, 9, 700], _good()[1], 5),
    "NaN": (_good()[0], [0.5, float("nan"), 0.25, 0.25], 5),
    "negative probability": (_good()[0], [0.75, -0.25, 0.25, 0.25], 5),
    "infinite probability": (_good()[0], [0.5, float("inf"), 0.25, 0.25], 5),
    "sum off": (_good()[0], [0.5, 0.25, 0.125, 0.0625], 5),
    "drafted token outside": (*_good(), 6),
    "drafted token of mass 0": (_good()[0], [0.5, 0.5, 0.0, 0.0], 2),
    "NaN before +inf and -inf": (_good()[0], [float("nan"), float("inf"), float("-inf"), 0.5], 5),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("where", ["between good ones", "alone", "first", "every one"])
def test_a_bad_packed_q_is_refused_as_the_lists_are(case, where):
    """Wherever it sits: between two good q's of its size the batched check's
    verdict never decided the outcome (a check inverted to pass bad q's went
    unnoticed), so the bad one also comes alone, first, and as all of them."""
    ids, probs, x = BAD[case]
    good_ids, good_probs = _good()
    good, bad = ((good_ids, good_probs), 5), ((ids, probs), x)
    layout = {"between good ones": [good, bad, good], "alone": [bad], "first": [bad, good],
              "every one": [bad, bad]}[where]
    lists = [q for q, _ in layout]
    wire = [packed(*q) for q in lists]
    drafted = [d for _, d in layout]
    with pytest.raises(ValueError) as from_lists:
        check_many(lists, drafted, VOCAB)
    with pytest.raises(ValueError) as from_packed:
        check_many(wire, drafted, VOCAB)
    assert str(from_packed.value) == str(from_lists.value)
    assert str(from_packed.value).startswith(f"draft_q[{layout.index(bad)}]: ")


def test_malformed_packed_fields_are_refused():
    with pytest.raises(ValueError, match=r"draft_q\[0\]: packed sparse distribution has 12 bytes"):
        check_many([b"\x01" * 12], [1], VOCAB)
    both = common_pb2.SparseDistribution(token_ids=[1], probs=[1.0], packed=packed([1], [1.0]))
    with pytest.raises(ValueError, match=r"draft_q\[0\]: .*both its lists and `packed`"):
        check_many([q_wire.received(both)], [1], VOCAB)
    with pytest.raises(ValueError, match=r"draft_q\[0\]: sparse distribution is empty"):
        check_many([q_wire.received(common_pb2.SparseDistribution())], [1], VOCAB)


def test_a_bad_q_fails_its_item_alone_and_a_greedy_items_q_is_never_read():
    """In one Verify: a sampled item with good packed q's, one whose q's hold
    NaN, +inf and -inf, and a greedy item carrying junk (its q's are not
    read, as before they could be sent packed)."""
    from specdec.errors import InvalidArgument
    from specdec.rpc.model_service import SessionMeta
    from specdec.sampling.params import SamplingParams
    from target_service.verifier import Verifier, VerifyRequestItem

    verifier = Verifier(tiny_engine(model=TARGET_MODEL))
    sampled, greedy = (SessionMeta(params=SamplingParams(t, 0, 1.0), seed=3) for t in (0.8, 0.0))
    prompt = tokens(9, seed=8)
    good_sid, bad_sid = (verifier.open(prompt, sampled, 0)[0] for _ in range(2))
    greedy_sid = verifier.open(prompt, greedy, 0)[0]
    good = packed([5, 9, 2, 70], [0.5, 0.25, 0.125, 0.125])
    bad = packed([5, 9, 2, 70], [float("nan"), float("inf"), float("-inf"), 0.5])
    out = verifier.verify([VerifyRequestItem(good_sid, None, [], [5, 9], [good, good]),
                           VerifyRequestItem(bad_sid, None, [], [5, 9], [good, bad]),
                           VerifyRequestItem(greedy_sid, None, [], [5, 9], [b"junk", bad])])
    assert out.items[0].error is None and len(out.items[0].outcome.target_probs) == 2
    assert isinstance(out.items[1].error, InvalidArgument)
    assert str(out.items[1].error).startswith("draft_q[1]: sparse distribution has a negative, NaN or infinite")
    assert out.items[2].error is None and len(out.items[2].outcome.argmax_ids) == 3


# ------------------------------------------------------------ the services


@pytest.fixture(scope="module")
def services():
    with running_target(tiny_engine(model=TARGET_MODEL)) as (_, target, _l), \
            running_draft(tiny_engine(model=DRAFT_MODEL)) as (_, draft, _m):
        yield target, draft


def test_only_the_target_says_it_reads_packed_q(services):
    target, draft = services
    info = common_pb2.GetModelInfoRequest()
    assert target.GetModelInfo(info, timeout=T).info.reads_packed_q
    assert not draft.GetModelInfo(info, timeout=T).info.reads_packed_q


def test_a_draft_asked_to_pack_sends_the_same_q_packed(services):
    _, draft = services
    prompt = tokens(12, seed=5)
    replies = {}
    for pack in (False, True):
        sid = open_session(draft, prompt, seed=77, temperature=0.7).session_id
        request = draft_pb2.ProposeRequest(session_id=sid, num_draft_tokens=4, packed_q=pack)
        replies[pack] = list(draft.ProposeAll(draft_pb2.ProposeAllRequest(propose=request), timeout=T).drafts)
        streamed = list(draft.Propose(draft_pb2.ProposeRequest(session_id=sid, keep_length=len(prompt),
                                                                num_draft_tokens=4, packed_q=pack), timeout=T))
        assert [(d.token_id, d.q.packed, list(d.q.token_ids)) for d in streamed] == \
            [(d.token_id, d.q.packed, list(d.q.token_ids)) for d in replies[pack]]
    assert [d.token_id for d in replies[True]] == [d.token_id for d in replies[False]]
    for as_packed, as_lists in zip(replies[True], replies[False]):
        assert not as_packed.q.token_ids and not as_packed.q.probs and not as_lists.q.packed
        assert q_wire.unpack_lists(as_packed.q.packed) == (list(as_lists.q.token_ids), list(as_lists.q.probs))


def test_a_verify_of_packed_q_scores_as_one_of_lists(services):
    target, draft = services
    prompt = tokens(10, seed=6)
    d_sid = open_session(draft, prompt, seed=3, temperature=0.9).session_id
    request = draft_pb2.ProposeRequest(session_id=d_sid, num_draft_tokens=5)
    drafts = list(draft.ProposeAll(draft_pb2.ProposeAllRequest(propose=request), timeout=T).drafts)
    ids = [d.token_id for d in drafts]
    results = []
    for pack in (False, True):
        t_sid = open_session(target, prompt, seed=11, temperature=0.9).session_id
        item = target_pb2.VerifyItem(session_id=t_sid, draft_token_ids=ids)
        for d in drafts:
            q = item.draft_q.add()
            if pack:
                q.packed = packed(list(d.q.token_ids), list(d.q.probs))
            else:
                q.CopyFrom(d.q)
        (result,) = verify(target, item)
        assert not result.HasField("error"), result.error
        assert len(result.target_probs) == len(ids)
        result.session_id = ""
        results.append(result)
    assert results[0] == results[1]


# ------------------------------------------------------------ the orchestrator


def test_the_orchestrator_asks_for_packed_q_only_from_a_target_that_reads_them(monkeypatch):
    """A seeded sampled request gives the same tokens either way."""
    writes = []
    real_write = q_wire.write

    def spy(msg, dist, packed):
        writes.append(packed)
        real_write(msg, dist, packed)

    monkeypatch.setattr(draft_servicer.q_wire, "write", spy)
    target = tiny_model(seed=0, init_range=0.3)
    draft = tiny_model(seed=1, init_range=0.3)
    kwargs = dict(max_tokens=16, temperature=0.8, seed=2024, num_draft_tokens=3)
    outputs = {}
    for reads in (True, False):
        monkeypatch.setattr(TargetServicer, "reads_packed_q", reads)
        writes.clear()
        with running_system(tiny_engine(model=target), tiny_engine(model=draft)) as s:
            outputs[reads] = s.client.complete([3, 17, 42, 5], **kwargs).token_ids
            greedy = len(writes)
            s.client.complete([3, 17, 42, 5], max_tokens=6, temperature=0, num_draft_tokens=3)
            assert len(writes) == greedy, "a greedy request's drafts carry no q"
        assert writes and set(writes) == {reads}
    assert outputs[True] == outputs[False] and len(outputs[True]) == 16


def test_a_target_restarted_as_a_version_that_reads_no_packed_q_gets_lists(monkeypatch):
    """Without lanes nothing else re-reads a target's ModelInfo: the request's
    recovery does, so a target restarted in place as an older version (no
    `reads_packed_q`) is sent lists from then on, and the seeded request keeps
    its tokens."""
    from orchestrator.client import build_request
    from tests.test_orchestrator import _port, perturbed, without_eos

    writes = []
    real_write = q_wire.write
    monkeypatch.setattr(draft_servicer.q_wire, "write", lambda msg, dist, packed: (writes.append(packed),
                                                                                   real_write(msg, dist, packed)))
    monkeypatch.setattr(TargetServicer, "reads_packed_q", True)
    target = without_eos(tiny_model(seed=0, init_range=0.3))
    kwargs = dict(temperature=0.8, seed=99, num_draft_tokens=3)
    prompt = [3, 9, 27, 81, 5]
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.2, 3)), lanes=False) as s:
        alone = s.client.complete(prompt, max_tokens=24, **kwargs).token_ids
        port, tokens, restarted = s.target.port, [], None
        stream = s.client.stub.Generate(build_request(prompt, max_tokens=24, **kwargs), timeout=60)
        try:
            for i, reply in enumerate(stream):
                if reply.HasField("stats"):
                    assert reply.stats.target_recoveries >= 1
                    break
                tokens.extend(reply.chunk.token_ids)
                if i == 1:
                    s.target_loop.run(s.target.stop(0))
                    monkeypatch.setattr(TargetServicer, "reads_packed_q", False)  # the older version
                    writes.clear()
                    restarted = running_target(tiny_engine(model=target), server_cfg=_port(port))
                    restarted.__enter__()
        finally:
            if restarted is not None:
                restarted.__exit__(None, None, None)
    assert tokens == alone
    # The round in flight was drafted packed (the restarted target refuses it for
    # the session it lost, before reading a q); every round after the recovery, lists.
    first_list = writes.index(False)
    assert all(writes[:first_list]) and not any(writes[first_list:]), writes


def test_the_checks_of_a_qs_probabilities_say_what_an_entry_by_entry_check_says():
    """NaN, +-inf, negative values and zeros anywhere among valid float32 probabilities (a NaN first
    or last, where min() does or does not return it; inf beside -inf, which fsum refuses)."""
    from specdec.sampling.sparse_lists import sparse_problem

    rng = random.Random(5)
    specials = [float("nan"), float("inf"), float("-inf"), -1e-9, -0.0, 0.0, -3.0, 3.4e38]
    for case in range(4000):
        n = rng.randint(1, 12)
        ps = [struct.unpack("<f", struct.pack("<f", p))[0] for p in (rng.random() for _ in range(n))]
        total = sum(ps)
        ps = [struct.unpack("<f", struct.pack("<f", p / total))[0] for p in ps]
        for _ in range(rng.choice((0, 0, 1, 2, 3))):
            ps[rng.randrange(n)] = rng.choice(specials)
        ids = rng.sample(range(50), n)
        got = sparse_problem(ids, ps, 50, drafted_id=rng.choice(ids + [49]))
        if not all(0.0 <= p < math.inf for p in ps):  # the check entry by entry, as first written
            assert got == "sparse distribution has a negative, NaN or infinite probability", ps
        else:
            assert got is None or "negative" not in got, ps
