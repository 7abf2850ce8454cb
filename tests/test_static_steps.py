"""Fixed-shape steps on the CPU: the bucketing and padding rules of the path
that CUDA captures as graphs, checked against the exact-size eager path.
(The captured graphs themselves are checked in tests/test_gpu_engine.py.)"""
from __future__ import annotations

import pytest
import torch

from specdec.engine.engine import ExtendItem
from specdec.engine.static_steps import token_buckets
from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted
from tests.conftest import TINY_VOCAB, tiny_engine, tiny_model
from tests.test_engine import random_tokens

ATOL = 1e-4


def engines(arch="llama", max_tokens=24, **cfg):
    """The same model twice: exact-size eager steps, and padded static steps."""
    cfg.setdefault("max_context", 128)
    eager = tiny_engine(arch, model=tiny_model(arch), **cfg)
    static = tiny_engine(arch, model=tiny_model(arch), **cfg)
    static.use_static_steps(max_tokens)
    return eager, static


def both(eager, static, fn):
    return fn(eager), fn(static)


def test_buckets_cover_every_size_and_pad_little():
    buckets = token_buckets(160)
    assert buckets[:16] == list(range(1, 17)) and buckets[-1] == 160
    assert token_buckets(5) == [1, 2, 3, 4, 5]
    for n in range(1, 161):
        b = buckets[next(i for i, s in enumerate(buckets) if s >= n)]
        assert n <= b <= max(n + 32, 16)


def test_a_step_is_padded_to_its_bucket_and_padding_touches_only_scratch():
    _, static = engines(max_tokens=40)
    steps = static.steps
    assert steps.bucket(17) == 24 and steps.bucket(25) == 32 and steps.fits(40) and not steps.fits(41)
    seqs = [random_tokens(n, seed=n) for n in (4, 9, 6)]
    sessions = [static.open_session(seq) for seq in seqs]
    sizes = []  # the token count of each forward pass the model runs
    steps.model.register_forward_pre_hook(lambda _model, _args, kwargs: sizes.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    before = static.store.keys.clone()
    static.extend([ExtendItem(s.id, None, [5, 6], 3) for s in sessions])  # 3 rows x 3 tokens = 9 -> bucket 9
    static.extend([ExtendItem(s.id, None, [5, 6, 7, 8], 2) for s in sessions])  # 3 x 4 new = 12 -> 12
    static.extend([ExtendItem(sessions[0].id, None, list(range(3, 20)), 1)])  # 18 -> bucket 24: 6 padding
    now = static.store.keys
    same = (now == before) | (now.isnan() & before.isnan())  # unwritten memory may hold NaN
    changed = (~same).any(dim=(0, 1, 3)).nonzero().flatten().tolist()
    allowed = set()
    for s in sessions:
        base = static.store.base(s.slot)
        allowed.update(range(base, base + s.length))
    allowed.add(static.store.scratch_index)
    assert set(changed) <= allowed
    assert sizes == [9, 12, 24]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_static_steps_equal_eager_steps_for_mixed_lengths_and_rollback(arch):
    eager, static = engines(arch)
    outs = []
    for engine in (eager, static):
        seqs = [random_tokens(n, seed=20 + n) for n in (3, 11, 30, 7)]
        sessions = [engine.open_session(seq[:2]) for seq in seqs]
        got = engine.extend([ExtendItem(s.id, None, seq[2:], len(seq) - 1) for s, seq in zip(sessions, seqs)])
        got += engine.extend([ExtendItem(s.id, None, [9, 10, 11], 4) for s in sessions])  # a verify-shaped step
        engine.rollback(sessions[2].id, 12)
        got += engine.extend([ExtendItem(s.id, None, [12], 1) for s in sessions])  # a decode-shaped step
        got += engine.extend([ExtendItem(sessions[1].id, 5, [4, 4, 4], 2)])  # keep_length on the call
        outs.append(got)
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_a_session_grows_to_the_end_of_its_slot_through_static_steps():
    eager, static = engines(max_context=64, max_tokens=8)
    seq = random_tokens(64, seed=3)
    for engine in (eager, static):
        s = engine.open_session(seq[:2])
        logits = [engine.extend([ExtendItem(s.id, None, [t], 1)])[0] for t in seq[2:]]
        engine.outs = logits
        assert s.length == 64
    for a, b in zip(eager.outs, static.outs):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_steps_larger_than_the_biggest_bucket_run_eagerly():
    eager, static = engines(max_tokens=8)
    seq = random_tokens(40, seed=4)
    a, b = both(eager, static, lambda e: e.extend([ExtendItem(e.open_session(seq[:5]).id, None, seq[5:], 35)])[0])
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_budget_exhaustion_and_a_bad_item_leave_static_sessions_untouched():
    _, static = engines(max_kv_bytes=(2 * 128 + 1) * 512)  # two slots of 128 tokens and the scratch position, 512 B a token
    a = static.open_session(random_tokens(8, seed=6))
    b = static.open_session(random_tokens(8, seed=7))
    with pytest.raises(ResourceExhausted, match="all 2 session slots"):
        static.open_session([3])
    def written():  # the valid prefixes (the rest of the store is uninitialized memory)
        return [static.store.keys[:, :, static.store.base(s.slot): static.store.base(s.slot) + s.cached].clone()
                for s in (a, b)]
    keys = written()
    state = (list(a.tokens), a.cached, list(b.tokens), b.cached)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        static.extend([ExtendItem(a.id, 4, [5], 1), ExtendItem(b.id, None, [TINY_VOCAB], 1)])
    with pytest.raises(OutOfRange):
        static.extend([ExtendItem(a.id, 4, [5], 1), ExtendItem(b.id, 9, [5], 1)])
    assert (list(a.tokens), a.cached, list(b.tokens), b.cached) == state
    assert all(torch.equal(x, y) for x, y in zip(written(), keys))
