"""The static KV store: slots from a budget, in-place writes, and attention
that reads each session's prefix where it lies (the reference SDPA kernel and
the fused Triton kernel, the latter under Triton's CPU interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specdec.engine.attention import row_mask, sdpa_rows
from specdec.engine.kv_store import KVShape, KVStore, RowSpan, StepLayout, StoreCache, slots_for_budget
from specdec.engine.sessions import ContextRules, Session, SessionTable
from specdec.errors import InvalidArgument, NotFound, OutOfRange, ResourceExhausted

SHAPE = KVShape(num_layers=2, kv_heads=2, head_dim=8, value_dim=8, dtype=torch.float32, device=torch.device("cpu"))


def dense_reference(q, keys_per_row, values_per_row, positions_per_row):
    """Plain softmax attention, one query at a time: q [Hq, T, D]."""
    outs = []
    t = 0
    for keys, values, positions in zip(keys_per_row, values_per_row, positions_per_row):
        group = q.shape[0] // keys.shape[0]
        k = keys.repeat_interleave(group, 0)
        v = values.repeat_interleave(group, 0)
        for pos in positions:
            scores = (q[:, t : t + 1] @ k[:, : pos + 1].transpose(1, 2)) * q.shape[-1] ** -0.5
            outs.append(torch.softmax(scores, -1) @ v[:, : pos + 1])
            t += 1
    return torch.cat(outs, dim=1).transpose(0, 1)  # [T, Hq, D]


def test_slots_come_from_the_budget():
    per_slot = SHAPE.bytes_per_token * 100
    # the scratch position (what padding tokens read) is in the budget too
    assert slots_for_budget(SHAPE, 100, 5 * per_slot + SHAPE.bytes_per_token, max_sessions=64) == 5
    assert slots_for_budget(SHAPE, 100, 5 * per_slot, max_sessions=64) == 4
    assert slots_for_budget(SHAPE, 100, 50 * per_slot, max_sessions=8) == 8
    with pytest.raises(ResourceExhausted, match="holds no session"):
        slots_for_budget(SHAPE, 100, per_slot - 1, max_sessions=8)


def test_slots_are_allocated_released_and_refused_when_all_are_taken():
    store = KVStore(SHAPE, num_slots=2, slot_tokens=10)
    a, b = store.allocate(), store.allocate()
    assert {a, b} == {0, 1} and store.slots_in_use == 2
    with pytest.raises(ResourceExhausted, match="all 2 session slots of 10 tokens"):
        store.allocate()
    store.release(a)
    assert store.allocate() == a
    assert store.base(1) == 10 and store.scratch_index == 20
    assert torch.all(store.keys[:, :, store.scratch_index] == 0)


def test_a_step_writes_its_keys_and_values_in_place():
    store = KVStore(SHAPE, num_slots=3, slot_tokens=10)
    ptr = store.keys.data_ptr()
    write = torch.tensor([2 * 10 + 4, 2 * 10 + 5, 0 * 10 + 7, store.scratch_index])
    layout = StepLayout(rows=[], write_index=write, key_base=write, position=write.int())
    cache = StoreCache(store, layout)
    k = torch.randn(1, 2, 4, 8)
    v = torch.randn(1, 2, 4, 8)
    keys, values = cache.layers[1].update(k, v)
    assert keys.data_ptr() == store.keys[1].data_ptr() and store.keys.data_ptr() == ptr
    torch.testing.assert_close(store.keys[1][:, 24], k[0, :, 0])
    torch.testing.assert_close(store.values[1][:, 7], v[0, :, 2])
    torch.testing.assert_close(store.keys[1][:, 25], k[0, :, 1])


def _mixed_rows(store_tokens=3 * 50 + 1, seed=0):
    """Three sessions of different lengths in slots 2, 0, 1 of a 50-token
    store: 5 new tokens at 30..34, 1 at 9, 3 at 0..2."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(2, store_tokens, 8, generator=g)
    value = torch.randn(2, store_tokens, 8, generator=g)
    spans = [(2, 30, 5), (0, 9, 1), (1, 0, 3)]
    rows, t = [], 0
    for slot, first, n in spans:
        rows.append(RowSpan(t, t + n, slot * 50, first, row_mask(n, first, "cpu")))
        t += n
    q = torch.randn(1, 4, t, 8, generator=g)
    return q, key, value, rows, spans


def test_reference_kernel_reads_each_sessions_prefix_only():
    q, key, value, rows, spans = _mixed_rows()
    out = sdpa_rows(q, key, value, rows, 8 ** -0.5)[0]
    ref = dense_reference(q[0], [key[:, s * 50 : s * 50 + 50] for s, _, _ in spans],
                          [value[:, s * 50 : s * 50 + 50] for s, _, _ in spans],
                          [range(f, f + n) for _, f, n in spans])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # Stale data beyond each prefix is never read.
    key[:, 35:50] = float("nan")
    key[:, 60:100] = float("nan")
    assert torch.isfinite(sdpa_rows(q, key, value, rows, 8 ** -0.5)).all()


def test_session_table_and_context_rules():
    table: SessionTable[Session] = SessionTable(max_sessions=1)
    s = table.add(Session(id="a", tokens=[1, 2, 3]))
    with pytest.raises(ResourceExhausted, match="limit 1"):
        table.add(Session(id="b", tokens=[1]))
    with pytest.raises(NotFound, match="unknown or expired"):
        table.get("b")
    s.last_used -= 100
    assert table.idle(10) == [s] and table.pop("a") is s and table.pop("a") is None
    rules = ContextRules(vocab_size=10, max_context=5)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        rules.check_tokens([10], "prompt")
    with pytest.raises(InvalidArgument, match="exceeds the context limit"):
        rules.check_open([1, 2], 4)
    with pytest.raises(OutOfRange, match="holds only 3"):
        rules.check_keep(s, 4)
    with pytest.raises(OutOfRange, match="beyond the context limit of 5"):
        rules.check_length(s, 6)


TRITON_CHECK = textwrap.dedent("""
    import torch
    from tests.test_kv_store import _mixed_rows
    from specdec.engine.attention import sdpa_rows
    from specdec.engine.triton_attention import attend
    for seed in range(3):
        q, key, value, rows, spans = _mixed_rows(seed=seed)
        ref = sdpa_rows(q, key, value, rows, 8 ** -0.5)[0]
        base = torch.tensor([r.base for r in rows for _ in range(r.start, r.stop)], dtype=torch.int32)
        pos = torch.tensor([p for r in rows for p in range(r.first_position, r.end)], dtype=torch.int32)
        key[:, 35:50] = float("nan")  # stale data past a prefix must not leak in
        out = attend(q[0].transpose(0, 1), key, value, base, pos, 8 ** -0.5, block_n=16)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    print("ok")
""")


def _run_interpreted(code: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fused_kernel_equals_the_reference_kernel():
    proc = _run_interpreted(TRITON_CHECK)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


ENGINE_CHECK = textwrap.dedent("""
    import torch
    from specdec.engine.engine import ExtendItem
    from tests.conftest import tiny_engine, tiny_model
    from tests.test_engine import random_tokens
    for arch in ("llama", "qwen2", "gpt2"):
        ref = tiny_engine(arch, attention="sdpa", max_context=128)
        fused = tiny_engine(arch, model=tiny_model(arch), attention="triton", max_context=128)
        assert fused.kernel == "triton"
        outs = []
        for engine in (ref, fused):
            seqs = [random_tokens(n, seed=n) for n in (5, 30, 12)]
            sessions = [engine.open_session(seq[:3]) for seq in seqs]
            outs.append(engine.extend([ExtendItem(s.id, None, seq[3:], len(seq) - 3) for s, seq in zip(sessions, seqs)]))
            engine.rollback(sessions[1].id, 10)
            outs.append(engine.extend([ExtendItem(s.id, None, [7, 8], 2) for s in sessions]))
        for a, b in zip(outs[:2], outs[2:]):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
    print("ok")
""")


def test_engine_with_the_fused_kernel_equals_the_reference_engine():
    proc = _run_interpreted(ENGINE_CHECK)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
