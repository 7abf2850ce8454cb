"""The model engine: KV rollback, batched forward, isolation and limits."""
from __future__ import annotations

import pytest
import torch

from specdec.engine.engine import ExtendItem
from specdec.errors import InvalidArgument, NotFound, OutOfRange, ResourceExhausted
from tests.conftest import TINY_VOCAB, tiny_engine

ATOL = 1e-4


def reference_logits(engine, tokens):
    """Logits of a fresh, cache-free forward over the whole sequence: [n, V]."""
    with torch.inference_mode():
        return engine.model(torch.tensor([tokens])).logits[0]


def random_tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist()


def test_extend_returns_logits_of_the_last_positions(arch):
    engine = tiny_engine(arch)
    seq = random_tokens(30)
    ref = reference_logits(engine, seq)
    s = engine.open_session(seq[:10])
    logits = engine.extend([ExtendItem(s.id, None, seq[10:30], num_logits=21)])[0]
    assert logits.shape == (21, engine.vocab_size)
    torch.testing.assert_close(logits, ref[9:30], atol=ATOL, rtol=0)
    assert s.length == 30


@pytest.mark.parametrize("keep", [0, 1, 7, 20, 29])
def test_rollback_then_reextend_equals_a_fresh_run(arch, keep):
    engine = tiny_engine(arch)
    seq = random_tokens(30, seed=1)
    other = random_tokens(12, seed=2)
    s = engine.open_session(seq[:5])
    engine.extend([ExtendItem(s.id, None, seq[5:30], 1)])
    if keep:  # a Rollback keeps >= 1 token; a cut to 0 rides on the extend, which appends at once
        assert engine.rollback(s.id, keep) == keep
    new = seq[:keep] + other if keep else other
    logits = engine.extend([ExtendItem(s.id, None if keep else 0, other, num_logits=len(other))])[0]
    ref = reference_logits(engine, new)
    torch.testing.assert_close(logits, ref[-len(other):], atol=ATOL, rtol=0)


def test_rollback_to_current_length_is_a_noop_and_past_the_end_is_an_error():
    engine = tiny_engine()
    seq = random_tokens(12)
    s = engine.open_session(seq)
    engine.extend([ExtendItem(s.id, None, [5, 6], 1)])
    cached_before = s.cached
    assert engine.rollback(s.id, 14) == 14
    assert s.cached == cached_before and s.tokens == seq + [5, 6]
    with pytest.raises(OutOfRange, match="holds only 14"):
        engine.rollback(s.id, 15)
    with pytest.raises(InvalidArgument):
        engine.rollback(s.id, -1)
    with pytest.raises(InvalidArgument, match="at least 1 token"):
        engine.rollback(s.id, 0)  # refused, not absorbed: the session stays usable
    assert s.tokens == seq + [5, 6]
    assert engine.rollback(s.id, 1) == 1


def test_keep_length_rides_on_extend():
    engine = tiny_engine()
    seq = random_tokens(20, seed=3)
    s = engine.open_session(seq[:10])
    engine.extend([ExtendItem(s.id, None, [7, 8, 9], 1)])  # drafted, to be rejected
    logits = engine.extend([ExtendItem(s.id, 10, seq[10:20], 10)])[0]
    torch.testing.assert_close(logits, reference_logits(engine, seq)[10:20], atol=ATOL, rtol=0)


def test_rollback_is_constant_time_in_context_length():
    # A rollback moves a pointer; the store is not touched.
    engine = tiny_engine(max_context=1024)
    s = engine.open_session(random_tokens(1000))
    keys_ptr = engine.store.keys.data_ptr()
    before = engine.store.keys.clone()
    engine.rollback(s.id, 3)
    assert engine.store.keys.data_ptr() == keys_ptr and s.cached == 3
    assert torch.equal(engine.store.keys.nan_to_num(), before.nan_to_num())  # unwritten memory may hold NaN


def test_batched_forward_equals_per_session_forward_with_mixed_lengths(arch):
    engine = tiny_engine(arch)
    seqs = [random_tokens(n, seed=10 + n) for n in (3, 17, 40, 9)]
    splits = [1, 12, 33, 8]  # prompt lengths; the rest is appended in the batch
    sessions = [engine.open_session(seq[:k]) for seq, k in zip(seqs, splits)]
    items = [ExtendItem(s.id, None, seq[k:], len(seq) - k + 1) for s, seq, k in zip(sessions, seqs, splits)]
    batched = engine.extend(items)
    for seq, k, logits in zip(seqs, splits, batched):
        torch.testing.assert_close(logits, reference_logits(engine, seq)[k - 1:], atol=ATOL, rtol=0)


def test_sessions_are_isolated():
    engine = tiny_engine()
    a_seq, b_seq = random_tokens(20, seed=4), random_tokens(20, seed=5)
    a = engine.open_session(a_seq[:10])
    b = engine.open_session(b_seq[:10])
    engine.extend([ExtendItem(a.id, None, a_seq[10:], 1)])
    engine.rollback(a.id, 2)
    engine.close(a.id)
    logits = engine.extend([ExtendItem(b.id, None, b_seq[10:], 10)])[0]
    torch.testing.assert_close(logits, reference_logits(engine, b_seq)[10:], atol=ATOL, rtol=0)


def test_a_bad_item_leaves_every_session_untouched():
    engine = tiny_engine()
    a = engine.open_session(random_tokens(8, seed=6))
    b = engine.open_session(random_tokens(8, seed=7))
    before = (list(a.tokens), a.cached, list(b.tokens), b.cached)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.extend([ExtendItem(a.id, 4, [5], 1), ExtendItem(b.id, None, [TINY_VOCAB], 1)])
    with pytest.raises(OutOfRange):
        engine.extend([ExtendItem(a.id, 4, [5], 1), ExtendItem(b.id, 9, [5], 1)])
    assert (list(a.tokens), a.cached, list(b.tokens), b.cached) == before


def test_prefill_in_chunks_equals_one_pass():
    engine = tiny_engine(prefill_chunk=7)
    seq = random_tokens(50, seed=8)
    s = engine.open_session(seq[:45])
    logits = engine.extend([ExtendItem(s.id, None, seq[45:], 6)])[0]
    torch.testing.assert_close(logits, reference_logits(engine, seq)[44:], atol=ATOL, rtol=0)


def test_long_append_is_prefed_in_chunks():
    engine = tiny_engine(prefill_chunk=8)
    seq = random_tokens(60, seed=9)
    s = engine.open_session(seq[:2])
    logits = engine.extend([ExtendItem(s.id, None, seq[2:], 3)])[0]
    torch.testing.assert_close(logits, reference_logits(engine, seq)[-3:], atol=ATOL, rtol=0)


def test_a_session_grows_step_by_step_to_the_end_of_its_slot():
    engine = tiny_engine(max_context=80)
    seq = random_tokens(80, seed=11)
    s = engine.open_session(seq[:3])
    for i in range(3, 80, 5):
        engine.extend([ExtendItem(s.id, None, seq[i:i + 5], 1)])
    assert s.cached == 80 and s.length == 80
    logits = engine.extend([ExtendItem(s.id, 70, seq[70:80], 10)])[0]
    torch.testing.assert_close(logits, reference_logits(engine, seq)[70:80], atol=ATOL, rtol=0)


def test_kv_accounting_per_session():
    engine = tiny_engine(max_context=256)
    per_token = engine.kv_shape.bytes_per_token
    assert per_token == 2 * 2 * 2 * 16 * 4  # layers * (k+v) * kv_heads * head_dim * fp32
    assert engine.slot_bytes == 256 * per_token
    s = engine.open_session(random_tokens(10), max_new_tokens=50)
    assert engine.kv_bytes_reserved == engine.slot_bytes
    engine.close(s.id)
    assert engine.kv_bytes_reserved == 0


def test_limits_give_clear_errors():
    engine = tiny_engine(max_sessions=2, max_context=64)
    with pytest.raises(InvalidArgument, match="empty"):
        engine.open_session([])
    with pytest.raises(InvalidArgument, match="exceeds the context limit"):
        engine.open_session(random_tokens(10), max_new_tokens=60)
    a = engine.open_session(random_tokens(60))
    engine.open_session(random_tokens(3))
    with pytest.raises(ResourceExhausted, match="too many open sessions"):
        engine.open_session(random_tokens(3))
    with pytest.raises(OutOfRange, match="context limit"):
        engine.extend([ExtendItem(a.id, None, random_tokens(5), 1)])
    with pytest.raises(NotFound):
        engine.extend([ExtendItem("nope", None, [3], 1)])
    with pytest.raises(InvalidArgument, match="twice"):
        engine.extend([ExtendItem(a.id, None, [3], 1), ExtendItem(a.id, None, [4], 1)])


def test_the_kv_budget_decides_how_many_sessions_fit():
    per_token = 2 * 2 * 2 * 16 * 4
    engine = tiny_engine(max_context=100, max_kv_bytes=250 * per_token)
    assert engine.store.num_slots == 2
    a = engine.open_session(random_tokens(10), max_new_tokens=50)
    engine.open_session(random_tokens(10))
    with pytest.raises(ResourceExhausted, match="KV cache budget exhausted: all 2 session slots"):
        engine.open_session(random_tokens(10))
    engine.close(a.id)  # its slot is free again
    engine.open_session(random_tokens(10))


def test_a_budget_too_small_for_one_session_is_refused_at_start():
    with pytest.raises(ResourceExhausted, match="holds no session of 100 tokens"):
        tiny_engine(max_context=100, max_kv_bytes=1000)


def test_close_twice_is_harmless_and_idle_sessions_expire():
    engine = tiny_engine()
    s = engine.open_session(random_tokens(4))
    assert engine.close(s.id) is True
    assert engine.close(s.id) is False
    t = engine.open_session(random_tokens(4))
    t.last_used -= 100
    assert engine.expire_idle(ttl_s=10) == [t.id]
    assert engine.num_sessions == 0


def test_session_ids_are_unguessable():
    engine = tiny_engine()
    ids = {engine.open_session([3]).id for _ in range(20)}
    assert len(ids) == 20 and all(len(i) >= 24 for i in ids)


def test_model_info():
    engine = tiny_engine("qwen2")
    info = engine.info
    assert info.vocab_size == TINY_VOCAB and info.eos_token_ids == (2,)
    assert info.kv_bytes_per_token == engine.kv_shape.bytes_per_token


def test_warmup_works_with_room_for_one_session_only():
    engine = tiny_engine(max_sessions=1)
    engine.warmup()
    assert engine.num_sessions == 0


@pytest.mark.parametrize("max_context", [2, 5, 11])
def test_warmup_fits_any_context_limit_the_settings_allow(max_context):
    """Every service warms up at start: with --max-context below 12 it failed
    (an 8-token prompt, then 12 tokens), and the service could not start."""
    engine = tiny_engine("qwen2", max_context=max_context)
    engine.warmup()
    assert engine.num_sessions == 0 and engine.store.slots_in_use == 0


def test_the_kv_store_stays_within_its_byte_budget():
    """The store holds a scratch position beside its slots; a budget of
    exactly N slots gave N slots and one position more than the budget."""
    probe = tiny_engine("qwen2", max_context=64)
    budget = probe.kv_shape.bytes_per_token * 64 * 3
    engine = tiny_engine("qwen2", max_context=64, max_kv_bytes=budget)
    assert engine.store.nbytes <= budget
    assert engine.store.num_slots == 2


def test_cpu_free_memory_counts_reclaimable_cache():
    """The default KV budget is half the free memory: on a CPU that must be
    MemAvailable (page cache included), not MemFree, which is small right
    after weights were read from disk and left a service without one slot."""
    import os

    from specdec.engine.loading import free_device_memory

    mem_free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert free_device_memory(torch.device("cpu")) >= mem_free
