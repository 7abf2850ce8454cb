"""Review of session opening (prefill) and the KV store: randomized programs of
opens (batched, joined between passes, refused, abandoned), extends with
rollbacks, explicit rollbacks, closes and idle expiry, each session's logits
checked against a fresh full forward of the model over its tokens, and the
slot bookkeeping checked after every operation."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.engine.engine import ExtendItem
from specdec.errors import InvalidArgument, NotFound, OutOfRange, ResourceExhausted
from tests.conftest import TINY_VOCAB, tiny_engine

ATOL = 1e-4


def reference_logits(engine, tokens):
    with torch.inference_mode():
        return engine.model(torch.tensor([tokens])).logits[0]


def check_slots(engine, opening_sessions=()):
    """Every open session owns one slot, no two the same, and the free list is the rest."""
    sessions = engine._sessions.values()
    slots = [s.slot for s in sessions]
    assert len(set(slots)) == len(slots), slots
    free = engine.store._free
    assert len(set(free)) == len(free), free
    assert not set(free) & set(slots), (free, slots)
    assert len(free) + len(slots) == engine.store.num_slots
    assert engine.store.slots_in_use == engine.num_sessions
    for s in sessions:
        assert 0 <= s.cached <= s.length <= engine.max_context


def _prompt(rng, n):
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


def run_program(seed, arch="llama", max_context=40, chunk=7, max_sessions=6, slots=None, steps=120):
    rng = random.Random(seed)
    cfg = dict(max_context=max_context, prefill_chunk=chunk, max_sessions=max_sessions)
    probe = tiny_engine(arch, **cfg)
    if slots is not None:  # a KV budget of exactly `slots` slots (and the scratch position)
        cfg["max_kv_bytes"] = slots * probe.store.bytes_per_slot + probe.kv_shape.bytes_per_token
    engine = probe if slots is None else tiny_engine(arch, model=probe.model, **cfg)
    if slots is not None:
        assert engine.store.num_slots == min(slots, max_sessions)
    live: dict[str, list[int]] = {}  # session id -> its tokens, as the model should see them
    openings = []  # (job, {request index: prompt})

    def settle(job, prompts, results):
        for index, result in results:
            if isinstance(result, Exception):
                assert isinstance(result, (InvalidArgument, ResourceExhausted, RuntimeError)), result
                continue
            assert result.tokens == prompts[index] and result.length == len(prompts[index])
            assert not result.opening
            assert result.id not in live
            live[result.id] = list(prompts[index])

    def request(rng):
        kind = rng.random()
        if kind < 0.05:
            return [], 0
        if kind < 0.1:
            return _prompt(rng, 3) + [TINY_VOCAB + 5], 0  # an id outside the vocabulary
        if kind < 0.15:
            return _prompt(rng, max_context), 1  # too long with max_new_tokens
        if kind < 0.2:
            return _prompt(rng, max_context), 0  # exactly the context limit
        n = min(max_context, rng.choice([1, 2, rng.randrange(1, max_context), rng.randrange(1, 12)]))
        return _prompt(rng, n), rng.randrange(0, max_context - n + 1)

    for _ in range(steps):
        op = rng.random()
        if op < 0.2:  # a new opening of 1..4 requests
            reqs = [request(rng) for _ in range(rng.randrange(1, 5))]
            job = engine.start_opening(reqs)
            prompts = {i: list(p) for i, (p, _) in enumerate(reqs)}
            settle(job, prompts, job.take_ready())
            openings.append((job, prompts))
        elif op < 0.3 and openings:  # requests join an opening between two passes
            job, prompts = rng.choice(openings)
            reqs = [request(rng) for _ in range(rng.randrange(1, 3))]
            for index, (p, _) in zip(job.add(reqs), reqs):
                prompts[index] = list(p)
            settle(job, prompts, job.take_ready())
        elif op < 0.5 and openings:  # one pass of an opening
            job, prompts = rng.choice(openings)
            job.step()
            settle(job, prompts, job.take_ready())
        elif op < 0.53 and openings:  # an opening abandoned
            job, prompts = openings.pop(rng.randrange(len(openings)))
            job.abandon()
            settle(job, prompts, job.take_ready())
        elif op < 0.75 and live:  # a batched extend, each with a cut and new tokens
            ids = rng.sample(sorted(live), rng.randrange(1, min(3, len(live)) + 1))
            items = []
            for sid in ids:
                length = len(live[sid])
                keep = rng.choice([None, length, rng.randrange(0, length + 1)])
                kept = length if keep is None else keep
                room = max_context - kept
                new = _prompt(rng, rng.randrange(0 if kept else 1, min(room, 9) + 1)) if room else []
                if kept + len(new) == 0:
                    keep, kept, new = None, length, []
                num = rng.randrange(1, kept + len(new) + 1) if rng.random() < 0.8 else 0
                num = min(num, kept + len(new))
                items.append(ExtendItem(sid, keep, new, num))
            out = engine.extend(items)
            for item, logits in zip(items, out):
                toks = live[item.session_id]
                if item.keep_length is not None:
                    del toks[item.keep_length:]
                toks.extend(item.tokens)
                assert engine.session(item.session_id).tokens == toks
                if item.num_logits:
                    ref = reference_logits(engine, toks)[-item.num_logits:]
                    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
        elif op < 0.82 and live:  # an explicit rollback
            sid = rng.choice(sorted(live))
            length = len(live[sid])
            to = rng.choice([0, length, length + 1, rng.randrange(1, length + 1)])
            if to < 1:
                with pytest.raises(InvalidArgument):
                    engine.rollback(sid, to)
            elif to > length:
                with pytest.raises(OutOfRange):
                    engine.rollback(sid, to)
            else:
                assert engine.rollback(sid, to) == to
                del live[sid][to:]
        elif op < 0.92 and live:  # a close (twice, sometimes)
            sid = rng.choice(sorted(live))
            assert engine.close(sid)
            del live[sid]
            assert not engine.close(sid)
            with pytest.raises(NotFound):
                engine.session(sid)
        elif op < 0.95:  # idle expiry: everything idle goes, nothing opening
            opening_ids = {s.id for job, _ in openings for s in job._sessions.values()}
            expired = engine.expire_idle(0.0)
            assert not set(expired) & opening_ids
            for sid in expired:
                live.pop(sid)
        check_slots(engine)
        assert set(live) | {s.id for job, _ in openings for s in job._sessions.values()} == {
            s.id for s in engine._sessions.values()}
    # finish the openings; then every session's next logits as a fresh run's
    for job, prompts in openings:
        job.results()
        settle(job, prompts, job.take_ready())
    check_slots(engine)
    for sid, toks in live.items():
        (logits,) = engine.extend([ExtendItem(sid, None, [], 1)])
        torch.testing.assert_close(logits, reference_logits(engine, toks)[-1:], atol=ATOL, rtol=0)
    for sid in list(live):
        assert engine.close(sid)
    assert engine.num_sessions == 0 and engine.store.slots_in_use == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_match_a_fresh_forward(seed):
    run_program(seed)


@pytest.mark.parametrize("seed", range(3))
def test_random_programs_under_a_kv_budget_of_fewer_slots_than_sessions(seed):
    run_program(100 + seed, slots=3, max_sessions=5)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_random_programs_other_architectures(arch):
    run_program(200, arch=arch, chunk=5, steps=80)
