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
- orchestrator: `accept_sampled` / `accept_greedy` make every accept decision and
  return a `RoundResult`.

Positions (see `specdec.sampling.rng`): first_position is the absolute index of x_1
in the token sequence, prompt included. With a 10-token prompt (positions 0..9)
and k = 2: x_1 is at 10, x_2 at 11, the bonus at 12. If x_1 is rejected the round
emits [r_1] (at 10) and the next round's x_1 is at 11; if x_1 is accepted and x_2
rejected it emits [x_1, r_2]; if both are accepted, [x_1, x_2, bonus].

The recovered and bonus tokens are drawn where the logits are (the GPU, on a GPU
target), in float64 (`sparse.pick_rows`): only O(k) numbers cross to the host, in
one transfer for all the sessions of a batched Verify (`score_many`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.sampling.params import SamplingParams
from specdec.sampling.rng import Stream, uniform, uniforms
from specdec.sampling.sparse import SparseDist, densify_many, pick_rows, sample, sample_dense
from specdec.sampling.transform import argmax_tokens, logits_to_probs


@dataclass
class VerifyOutcome:
    """What the target returns for one session's round of k drafts."""

    # Greedy only: argmax of p at each of the k+1 positions; [k+1]. Empty if sampled.
    argmax_ids: list[int] = field(default_factory=list)
    # Sampled only: p_i(x_i) as float32 values (exact through a proto float); [k].
    target_probs: list[float] = field(default_factory=list)
    # Sampled only: r_i from norm(max(0, p_i - q_i)), emitted if x_i is the first
    # rejected draft; [k].
    recovery_ids: list[int] = field(default_factory=list)
    # Sampled: drawn from p_{k+1}. Greedy: argmax_ids[k].
    bonus_id: int = -1


@dataclass
class RoundResult:
    """The orchestrator's decision for one round."""

    num_accepted: int  # drafts accepted, 0..k
    emitted_ids: list[int]  # the accepted drafts, then one recovered or bonus token


def draw_draft(q: SparseDist, seed: int, position: int) -> int:
    """The draft's x_i, sampled from q_i with the DRAFT uniform at x_i's position."""
    return sample(q, uniform(seed, position, Stream.DRAFT))


def sample_token(probs_row: torch.Tensor, seed: int, position: int) -> int:
    """Plain decoding: the target alone samples the token at position from probs_row [V].

    Uses the BONUS stream on purpose: a verify with k = 0 draws its bonus token with
    the same uniform from the same p, so it emits the same token as a plain decode
    step, and the two paths are interchangeable mid-request.
    """
    return sample_dense(probs_row, uniform(seed, position, Stream.BONUS))


@dataclass(frozen=True)
class ScoreJob:
    """One session's round, as `score_drafts` takes it."""

    target_logits: torch.Tensor  # [k+1, V]
    draft_ids: Sequence[int]
    draft_q: Sequence[SparseDist]
    params: SamplingParams
    seed: int
    first_position: int


class NoTargetMass(ValueError):
    """The target's distribution at some position has no finite mass (NaN or inf logits)."""


def score_drafts(
    target_logits: torch.Tensor,
    draft_ids: Sequence[int],
    draft_q: Sequence[SparseDist],
    params: SamplingParams,
    seed: int,
    first_position: int,
) -> VerifyOutcome:
    """The target's half of a round: everything that needs p, in O(k) numbers.

    target_logits [k+1, V]: row i-1 predicts the token at first_position + i - 1,
    i.e. rows 0..k-1 give p_1..p_k and row k gives p_{k+1}. draft_ids: x_1..x_k.
    draft_q: q_1..q_k, empty under greedy. Recovered token r_i uses the RECOVERY
    uniform at x_i's position; the bonus the BONUS uniform at first_position + k.
    If max(0, p_i - q_i) has no mass (p_i <= q_i everywhere, i.e. p_i == q_i),
    x_i is always accepted and r_i is never used; it is then drawn from p_i.
    """
    outcome = score_many([ScoreJob(target_logits, draft_ids, draft_q, params, seed, first_position)])[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def score_many(jobs: Sequence[ScoreJob]) -> list[VerifyOutcome | NoTargetMass]:
    """`score_drafts` of every session of a batched Verify, computed where the
    logits are and brought to the host in ONE transfer (one sync per Verify
    batch, whatever its size). A job whose p has no finite mass gets
    NoTargetMass, alone."""
    parts: list[torch.Tensor] = []
    for job in jobs:
        k = len(job.draft_ids)
        assert job.target_logits.dim() == 2 and job.target_logits.shape[0] == k + 1, (
            tuple(job.target_logits.shape), k)
        assert len(job.draft_q) == (0 if job.params.greedy else k), (len(job.draft_q), k, job.params)
        assert job.first_position >= 0, job.first_position
        if job.params.greedy:
            parts.append(argmax_tokens(job.target_logits).double())  # [k+1]
            continue
        p = logits_to_probs(job.target_logits, job.params)  # [k+1, V]
        vocab, device = p.shape[-1], p.device
        x = torch.tensor(list(job.draft_ids), dtype=torch.int64).to(device, non_blocking=True)  # [k]
        q = densify_many(job.draft_q, vocab, device)  # [k, V]
        residual = (p[:k] - q).clamp_min(0.0)  # [k, V]
        no_mass = ~(residual > 0).any(dim=-1, keepdim=True)  # [k, 1]
        residual = torch.where(no_mass, p[:k], residual)
        us = uniforms(job.seed, range(job.first_position, job.first_position + k), Stream.RECOVERY)
        us.append(uniform(job.seed, job.first_position + k, Stream.BONUS))
        drawn, ok = pick_rows(torch.cat([residual, p[k:]]), us)  # [k+1] each
        # float64 holds every float32 p_i(x_i) and every token id exactly
        parts += [p[:k].gather(-1, x[:, None])[:, 0].double(), drawn.double(), ok.double()]
    host = torch.cat(parts).tolist() if parts else []  # the one device-to-host transfer
    out: list[VerifyOutcome | NoTargetMass] = []
    at = 0
    for job in jobs:
        k = len(job.draft_ids)
        if job.params.greedy:
            argmax_ids = [int(t) for t in host[at: at + k + 1]]
            at += k + 1
            out.append(VerifyOutcome(argmax_ids=argmax_ids, bonus_id=argmax_ids[k]))
            continue
        target_probs, drawn, ok = host[at: at + k], host[at + k: at + 2 * k + 1], host[at + 2 * k + 1: at + 3 * k + 2]
        at += 3 * k + 2
        if not all(ok):
            out.append(NoTargetMass("the target model's distribution has no finite mass (NaN or inf logits)"))
            continue
        drawn = [int(t) for t in drawn]
        out.append(VerifyOutcome(target_probs=target_probs, recovery_ids=drawn[:k], bonus_id=drawn[k]))
    return out


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
) -> RoundResult:
    """The orchestrator's accept decisions for a sampled round.

    draft_q_of_x [k]: q_i(x_i), normalized as `SparseDist.prob` gives it. x_i is
    accepted iff the ACCEPT uniform at its position is < p_i(x_i) / q_i(x_i), which
    happens with probability min(1, p_i(x_i) / q_i(x_i)).
    """
    k = len(draft_ids)
    assert len(draft_q_of_x) == k, (len(draft_q_of_x), k)
    assert len(outcome.target_probs) == k and len(outcome.recovery_ids) == k, outcome
    assert all(q > 0 for q in draft_q_of_x), draft_q_of_x
    us = uniforms(seed, range(first_position, first_position + k), Stream.ACCEPT)
    for i in range(k):
        if not us[i] < outcome.target_probs[i] / draft_q_of_x[i]:
            return RoundResult(i, [*draft_ids[:i], outcome.recovery_ids[i]])
    return RoundResult(k, [*draft_ids, outcome.bonus_id])
