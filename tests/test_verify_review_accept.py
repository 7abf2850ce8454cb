"""From a review of the verify path: the accept test's preparation for a
proposal whose probabilities sum to 0 (which the target refuses)."""
from __future__ import annotations

import asyncio

import pytest

from orchestrator.accept_prep import AcceptPrep
from specdec.v1 import draft_pb2
from tests.harness import DEADLINE_S


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
        import numpy as np
        msg.q.packed = np.array([7, 9], "<i4").tobytes() + np.array([0.0, 0.0], "<f4").tobytes()
    else:
        msg.q.token_ids.extend([7, 9])
        msg.q.probs.extend([0.0, 0.0])
    drafts = list(reply.drafts)
    errors = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        prep = AcceptPrep.schedule(drafts, seed=1, first_position=0)
        await asyncio.sleep(0)
        return prep

    prep = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert errors == [] and prep.q_of_x is None
    with pytest.raises(ZeroDivisionError):
        prep.values()
