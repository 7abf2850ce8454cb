"""What a sampled round's accept test needs before the target's reply,
made while the target computes.

The accept test (`specdec.sampling.rejection.accept_sampled`) compares, for
each draft x_i, an ACCEPT uniform with p_i(x_i) / q_i(x_i). Only p_i(x_i)
comes with the Verify reply: q_i(x_i) is read from the draft's proposal
(`q_wire.prob_of`), and the uniforms are a function of the request's seed and
the drafts' positions. Made after the reply, they sat on the round's path:
27 µs of a T = 0.7 round on the dev VM, timed in a running orchestrator (the
H200 host's orchestrator spent 84 µs more after the verify at T = 0.7 than
greedy). `AcceptPrep.schedule` makes them on the event loop's next turn,
which comes once the Verify is on the wire and the loop waits for its reply;
the accept test then reads them (`values`), or makes them itself where the
turn has not come (a reply can never be read before it: the loop runs the
callbacks already scheduled before it polls for the reply).
"""
from __future__ import annotations

import asyncio

from specdec.sampling import q_wire
from specdec.sampling.rng import Stream, uniforms


class AcceptPrep:
    """q_i(x_i) and the ACCEPT uniforms of one sampled round of `drafts`
    (ProposeResponse messages), the first at `first_position`."""

    __slots__ = ("drafts", "seed", "first_position", "q_of_x", "uniforms")

    def __init__(self, drafts: list, seed: int, first_position: int):
        self.drafts = drafts
        self.seed = seed
        self.first_position = first_position
        self.q_of_x: list[float] | None = None
        self.uniforms: list[float] | None = None

    @classmethod
    def schedule(cls, drafts: list, seed: int, first_position: int) -> AcceptPrep:
        """A prep made on the loop's next turn (call before awaiting the Verify)."""
        prep = cls(drafts, seed, first_position)
        asyncio.get_running_loop().call_soon(prep._make_ahead)
        return prep

    def _make_ahead(self) -> None:
        # A proposal that cannot be read (a packed q of a length no entries
        # make, probabilities summing to 0) fails the round where the accept
        # test reads it, if the target has not refused it first: not here,
        # as the loop's error log.
        try:
            self.make()
        except (ValueError, ArithmeticError):
            self.q_of_x = self.uniforms = None

    def make(self) -> None:
        if self.q_of_x is not None:
            return
        first = self.first_position
        self.uniforms = uniforms(self.seed, range(first, first + len(self.drafts)), Stream.ACCEPT)
        self.q_of_x = [q_wire.prob_of(d.q, d.token_id) for d in self.drafts]

    def values(self) -> tuple[list[float], list[float]]:
        """(q_i(x_i), the ACCEPT uniforms), made now if they were not yet."""
        self.make()
        return self.q_of_x, self.uniforms
