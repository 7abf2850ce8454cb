"""The rejection sampler of speculative decoding, split as the wire protocol needs.

Words used throughout specdec (Leviathan et al. 2023, Chen et al. 2023):

- k = num_draft_tokens (γ in the literature): how many tokens one round drafts,
  at most max_draft_tokens (`specdec.limits`); 0 in a round that decodes
  plainly. On the wire and in flags it is always num_draft_tokens; k is its
  short name in the math.
- p: the target distribution, q: the draft distribution, both AFTER the request's
  sampling transform (`logits_to_probs`, same params on both sides). p_i and q_i
  are those at the i-th drafted position, i = 1..k; p_{k+1} is the target's
  distribution after the last draft. q_i is the draft's truncated `SparseDist`.
- x_i: the i-th drafted token, sampled by the draft from q_i.
- accepted token: x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
  provided x_1..x_{i-1} were.
- rejected: the first x_i that is not accepted; it and every later draft are
  discarded.
- recovered token: emitted in place of the first rejected x_i, drawn from
  norm(max(0, p_i - q_i)) over the full vocabulary.
- bonus token: emitted when all k drafts are accepted, drawn from p_{k+1}.

A round therefore emits the accepted drafts followed by exactly one recovered or
bonus token, and each emitted token is distributed exactly as p given the tokens
before it.

Worked example (one position). p_1 = {a: .5, b: .3, c: .2}, q_1 = {a: .8, b: .2}.
The draft proposes a with probability .8 and it is accepted with probability
.5/.8, so a is emitted with probability .8 * .625 = .5. The rejected mass is
.8 * .375 = .3; the residual max(0, p_1 - q_1) = {b: .1, c: .2} normalizes to
{b: 1/3, c: 2/3}. b is emitted with probability .2 (proposed, and .3/.2 >= 1 so
always accepted) + .3 * 1/3 = .3, c with probability .3 * 2/3 = .2: exactly p_1.

Who does what, so that no full-vocabulary tensor crosses the network:

- draft: x_i = `draw_draft(q_i, seed, pos_i)`; sends x_i and q_i.
- target: `score_drafts` scores the k+1 positions in one forward pass and returns
  a `VerifyOutcome`: p_i(x_i), a recovered token pre-drawn for EVERY i (only the
  one at the first rejection is used), and the bonus token (greedy: the argmax of
  each of the k+1 rows instead).
- orchestrator: `accept_sampled` / `accept_greedy` (here) make every accept
  decision and return a `RoundResult`.

This module is the orchestrator's half, and imports no torch: the draft's and
the target's halves (`draw_draft`, `score_drafts`), which work on the models'
tensors, are in `specdec.sampling.scoring`.

Positions (see `specdec.sampling.rng`): first_position is the absolute index of x_1
in the token sequence, prompt included. With a 10-token prompt (positions 0..9)
and k = 2: x_1 is at 10, x_2 at 11, the bonus at 12. If x_1 is rejected the round
emits [r_1] (at 10) and the next round's x_1 is at 11; if x_1 is accepted and x_2
rejected it emits [x_1, r_2]; if both are accepted, [x_1, x_2, bonus].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.sampling.rng import Stream, keyed_uniform, seed_key


@dataclass
class VerifyOutcome:
    """What the target returns for one session's round of k drafts."""

    # Greedy only: argmax of p at each of the k+1 positions; [k+1]. Empty if sampled.
    argmax_ids: Sequence[int] = field(default_factory=list)
    # Sampled only: p_i(x_i) as float32 values (exact through a proto float); [k].
    target_probs: Sequence[float] = field(default_factory=list)
    # Sampled only: r_i from norm(max(0, p_i - q_i)), emitted if x_i is the first
    # rejected draft; [k].
    recovery_ids: Sequence[int] = field(default_factory=list)
    # Sampled: drawn from p_{k+1}. Greedy: argmax_ids[k].
    bonus_id: int = -1


@dataclass
class RoundResult:
    """The orchestrator's decision for one round."""

    num_accepted: int  # drafts accepted, 0..k
    emitted_ids: list[int]  # the accepted drafts, then one recovered or bonus token


def accept_greedy(draft_ids: Sequence[int], argmax_ids: Sequence[int]) -> RoundResult:
    """Accept while x_i == argmax p_i; then emit the target's argmax (or the bonus)."""
    k = len(draft_ids)
    assert len(argmax_ids) == k + 1, (len(argmax_ids), k)
    for i in range(k):
        if draft_ids[i] != argmax_ids[i]:
            return RoundResult(i, [*draft_ids[:i], argmax_ids[i]])
    return RoundResult(k, [*draft_ids, argmax_ids[k]])


def accept_sampled(
    draft_ids: Sequence[int],
    draft_q_of_x: Sequence[float],
    outcome: VerifyOutcome,
    seed: int,
    first_position: int,
    accept_uniforms: Sequence[float] | None = None,
) -> RoundResult:
    """The orchestrator's accept decisions for a sampled round.

    draft_q_of_x [k]: q_i(x_i), normalized as `SparseDist.prob` gives it. x_i is
    accepted iff the ACCEPT uniform at its position is < p_i(x_i) / q_i(x_i), which
    happens with probability min(1, p_i(x_i) / q_i(x_i)). Each uniform is drawn
    when its test comes (none after the first rejection), unless the caller
    drew them before (`accept_uniforms`: `uniforms(seed, positions, Stream.ACCEPT)`
    of the k drafts' positions, as orchestrator/accept_prep.py makes them while
    the target computes).
    """
    k = len(draft_ids)
    p_of_x = outcome.target_probs
    if len(draft_q_of_x) != k or len(p_of_x) != k or len(outcome.recovery_ids) != k:
        raise ValueError(f"a round of {k} drafts needs {k} q_i(x_i), p_i(x_i) and recovered tokens, got "
                         f"{len(draft_q_of_x)}, {len(p_of_x)} and {len(outcome.recovery_ids)}")
    if accept_uniforms is not None and len(accept_uniforms) != k:
        raise ValueError(f"a round of {k} drafts needs {k} accept uniforms, got {len(accept_uniforms)}")
    key = seed_key(seed) if accept_uniforms is None else 0
    for i in range(k):
        q = draft_q_of_x[i]
        if not q > 0:
            raise ValueError(f"draft {i} has q(x) = {q}: a draft proposes only tokens its own q gives mass")
        u = accept_uniforms[i] if accept_uniforms is not None else keyed_uniform(key, first_position + i, Stream.ACCEPT)
        if not u < p_of_x[i] / q:
            return RoundResult(i, [*draft_ids[:i], outcome.recovery_ids[i]])
    return RoundResult(k, [*draft_ids, outcome.bonus_id])
