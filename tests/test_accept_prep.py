"""What a sampled round's accept test needs, made while the target computes
(orchestrator/accept_prep.py): on the loop's next turn after the Verify is
sent, the same values the accept test would make itself, and the same
decisions."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from orchestrator.accept_prep import AcceptPrep
from specdec.sampling import q_wire
from specdec.sampling.rejection import VerifyOutcome, accept_sampled
from specdec.sampling.rng import Stream, uniforms
from specdec.sampling.sparse import SparseDist
from specdec.v1 import draft_pb2
from tests.harness import DEADLINE_S


def _drafts(rng: random.Random, k: int, packed: bool) -> list:
    reply = draft_pb2.ProposeAllResponse()
    for i in range(k):
        ids = rng.sample(range(5000), 8)
        weights = torch.tensor([rng.random() + 0.01 for _ in ids])
        dist = SparseDist(torch.tensor(ids), (weights / weights.sum()).float())
        msg = reply.drafts.add(index=i, token_id=ids[rng.randrange(8)])
        q_wire.write(msg.q, dist, packed)
    return list(reply.drafts)


def test_made_on_the_next_turn_before_a_reply_and_equal_to_making_them_after():
    rng = random.Random(0)

    async def main():
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        drafts = _drafts(rng, 4, packed=True)
        prep = AcceptPrep.schedule(drafts, seed=77, first_position=30)
        assert prep.q_of_x is None  # not on the caller's path
        loop.call_soon(lambda: reply.set_result(prep.q_of_x is not None))  # as a reply read on a later turn
        return prep, await reply

    prep, made_before_the_reply = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert made_before_the_reply
    assert prep.values() == ([q_wire.prob_of(d.q, d.token_id) for d in prep.drafts],
                             uniforms(77, range(30, 34), Stream.ACCEPT))


def test_values_are_made_on_the_spot_where_the_turn_has_not_come():
    drafts = _drafts(random.Random(1), 3, packed=False)
    prep = AcceptPrep(drafts, seed=5, first_position=0)
    assert prep.values() == ([q_wire.prob_of(d.q, d.token_id) for d in drafts], uniforms(5, range(3), Stream.ACCEPT))


def test_the_accept_test_decides_the_same_with_uniforms_made_before():
    rng = random.Random(2)
    for trial in range(300):
        k = rng.randrange(1, 6)
        drafts = _drafts(rng, k, packed=trial % 2 == 0)
        ids = [d.token_id for d in drafts]
        outcome = VerifyOutcome(target_probs=[rng.random() * 0.3 for _ in ids],
                                recovery_ids=[rng.randrange(5000) for _ in ids], bonus_id=9)
        q_of_x, us = AcceptPrep(drafts, trial, 100).values()
        made_before = accept_sampled(ids, q_of_x, outcome, trial, 100, accept_uniforms=us)
        assert made_before == accept_sampled(ids, q_of_x, outcome, trial, 100)


def _scheduled_catching_loop_errors(drafts) -> tuple[AcceptPrep, list]:
    """The prep of `drafts` after its turn of the loop, and what the loop's
    exception handler caught meanwhile."""
    errors = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        prep = AcceptPrep.schedule(drafts, seed=1, first_position=0)
        await asyncio.sleep(0)
        return prep

    return asyncio.run(asyncio.wait_for(main(), DEADLINE_S)), errors


def test_a_proposal_that_cannot_be_read_fails_the_accept_test_not_the_loop():
    drafts = _drafts(random.Random(3), 2, packed=True)
    drafts[1].q.packed = drafts[1].q.packed[:-3]  # no whole number of entries
    prep, errors = _scheduled_catching_loop_errors(drafts)
    assert errors == [] and prep.q_of_x is None
    with pytest.raises(ValueError, match="8 per entry"):
        prep.values()


@pytest.mark.parametrize("packed", [True, False])
def test_a_proposal_of_no_mass_fails_the_accept_test_not_the_loop(packed):
    """q(x) of a proposal whose probabilities are all 0 divides by their sum:
    made ahead on the loop's turn, the ZeroDivisionError went to the loop's
    error log ("Exception in callback AcceptPrep._make_ahead"), where only a
    ValueError was kept out of it. The target refuses such a proposal (it
    sums to 0, not 1) and the request ends with that; the loop logs nothing."""
    reply = draft_pb2.ProposeAllResponse()
    msg = reply.drafts.add(index=0, token_id=7)
    if packed:
        msg.q.packed = np.array([7, 9], "<i4").tobytes() + np.array([0.0, 0.0], "<f4").tobytes()
    else:
        msg.q.token_ids.extend([7, 9])
        msg.q.probs.extend([0.0, 0.0])
    prep, errors = _scheduled_catching_loop_errors(list(reply.drafts))
    assert errors == [] and prep.q_of_x is None
    with pytest.raises(ZeroDivisionError):
        prep.values()
