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

from specdec.host_copy import to_device
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
    NoTargetMass, alone.

    The jobs are scored in groups, not one by one: the greedy jobs together,
    and the sampled jobs of each `SamplingParams` together, each group as one
    set of tensor operations over all its rows. Per job that was ~85 tensor
    operations (8 sessions at T = 0.7: 691), each a kernel launch on a GPU,
    which made a sampled Verify of 8 sessions cost twice its forward pass on
    an H100 host. Every operation is row-wise (the transform, the residual,
    the inverse-CDF draw), so a job's outcome is the same in any group.
    """
    for job in jobs:
        k = len(job.draft_ids)
        assert job.target_logits.dim() == 2 and job.target_logits.shape[0] == k + 1, (
            tuple(job.target_logits.shape), k)
        assert len(job.draft_q) == (0 if job.params.greedy else k), (len(job.draft_q), k, job.params)
        assert job.first_position >= 0, job.first_position
    groups: dict[SamplingParams | None, list[int]] = {}  # None: the greedy jobs
    for j, job in enumerate(jobs):
        groups.setdefault(None if job.params.greedy else job.params, []).append(j)
    parts: list[torch.Tensor] = []
    readers = []
    at = 0
    for params, members in groups.items():
        for chunk in ([members] if params is None else _chunks(jobs, members)):
            group = [jobs[j] for j in chunk]
            part, read = _score_greedy(group) if params is None else _score_sampled(group, params)
            parts.append(part)
            readers.append((chunk, read, at))
            at += part.shape[0]
    host = torch.cat(parts).tolist() if parts else []  # the one device-to-host transfer
    out: list = [None] * len(jobs)  # every job is in one reader's members
    for members, read, start in readers:
        for j, outcome in zip(members, read(host, start)):
            out[j] = outcome
    return out


# On a CPU a sampled group's rows are scored together only up to this many
# elements of [rows, V] (a float64 copy of 2**20 is 8 MiB): larger intermediates
# are fresh mmaps whose page faults cost more than the operations saved (8
# sessions at k = 4 over Qwen's 151936 ids: 49 ms one by one, 124 ms as one group).
CPU_GROUP_ELEMENTS = 1 << 20


def _chunks(jobs: Sequence[ScoreJob], members: list[int]) -> list[list[int]]:
    """A sampled group's jobs in runs scored together: all of them on a GPU
    (where each operation is a launch, whatever its size), runs of at most
    `CPU_GROUP_ELEMENTS` elements elsewhere (a job larger than that alone)."""
    if jobs[members[0]].target_logits.device.type == "cuda":
        return [members]
    chunks: list[list[int]] = []
    size = CPU_GROUP_ELEMENTS + 1
    for j in members:
        rows = jobs[j].target_logits
        n = rows.shape[0] * rows.shape[1]
        if size + n > CPU_GROUP_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(j)
        size += n
    return chunks


def _rows(jobs: Sequence[ScoreJob]) -> torch.Tensor:
    """The jobs' logits as one [sum(k + 1), V] tensor, job after job: a view
    when they lie back to back in one tensor already (the engine's batched
    forward returns them so), else a copy."""
    logits = [job.target_logits for job in jobs]
    first = logits[0]
    if len(logits) == 1:
        return first
    vocab, size = first.shape[-1], first.element_size()
    storage = first.untyped_storage().data_ptr()
    at = first.data_ptr()
    for rows in logits:
        if (rows.stride() != (vocab, 1) or rows.shape[-1] != vocab or rows.dtype != first.dtype
                or rows.untyped_storage().data_ptr() != storage or rows.data_ptr() != at):
            return torch.cat(logits)
        at += rows.shape[0] * vocab * size
    return first.as_strided((sum(rows.shape[0] for rows in logits), vocab), (vocab, 1))


def _score_greedy(jobs: Sequence[ScoreJob]):
    """The argmax of every row of the greedy jobs: (float64 [R] to read back, reader)."""
    part = argmax_tokens(_rows(jobs)).double()  # float64 holds every token id exactly

    def read(host: list[float], at: int) -> list[VerifyOutcome]:
        out = []
        for job in jobs:
            k = len(job.draft_ids)
            argmax_ids = [int(t) for t in host[at: at + k + 1]]
            at += k + 1
            out.append(VerifyOutcome(argmax_ids=argmax_ids, bonus_id=argmax_ids[k]))
        return out
    return part, read


def _score_sampled(jobs: Sequence[ScoreJob], params: SamplingParams):
    """p_i(x_i), the recovered tokens and the bonus of sampled jobs that share
    `params`, for all their rows at once: (float64 [D + 2 (D + J)] to read back,
    reader), D the jobs' drafts, J the jobs."""
    p = logits_to_probs(_rows(jobs), params)  # [R, V], R = D + J
    device = p.device
    draft_rows, bonus_rows, ids, us_recovery, us_bonus = [], [], [], [], []
    row = 0
    for job in jobs:
        k = len(job.draft_ids)
        draft_rows += range(row, row + k)
        bonus_rows.append(row + k)
        row += k + 1
        ids += job.draft_ids
        us_recovery += uniforms(job.seed, range(job.first_position, job.first_position + k), Stream.RECOVERY)
        us_bonus.append(uniform(job.seed, job.first_position + k, Stream.BONUS))
    drafts = len(ids)
    if drafts:
        if len(jobs) == 1:  # views, no gather (on a CPU most groups are one job: _chunks)
            x = to_device(ids, device)
            p_drafts, p_bonus = p[:drafts], p[drafts:]
        else:
            index = to_device(draft_rows + bonus_rows + ids, device)  # one copy: rows, then x_i
            p_drafts, p_bonus, x = p[index[:drafts]], p[index[drafts: -drafts]], index[-drafts:]
        q = densify_many([q for job in jobs for q in job.draft_q], p.shape[-1], device)  # [D, V]
        residual = (p_drafts - q).clamp_min(0.0)  # [D, V]
        no_mass = ~(residual > 0).any(dim=-1, keepdim=True)  # [D, 1]
        residual = torch.where(no_mass, p_drafts, residual)
        drawn, ok = pick_rows(torch.cat([residual, p_bonus]), us_recovery + us_bonus)  # [D + J] each
        # float64 holds every float32 p_i(x_i) and every token id exactly
        part = torch.cat([p_drafts.gather(-1, x[:, None])[:, 0].double(), drawn.double(), ok.double()])
    else:  # plain rounds only: every row is a bonus row
        drawn, ok = pick_rows(p, us_bonus)
        part = torch.cat([drawn.double(), ok.double()])

    def read(host: list[float], at: int) -> list[VerifyOutcome | NoTargetMass]:
        n = drafts + len(jobs)  # rows drawn from: the residuals, then the bonus rows
        target_probs = host[at: at + drafts]
        drawn = host[at + drafts: at + drafts + n]
        ok = host[at + drafts + n: at + drafts + 2 * n]
        out: list[VerifyOutcome | NoTargetMass] = []
        d = 0
        for j, job in enumerate(jobs):
            k = len(job.draft_ids)
            if not (all(ok[d: d + k]) and ok[drafts + j]):
                out.append(NoTargetMass("the target model's distribution has no finite mass (NaN or inf logits)"))
            else:
                out.append(VerifyOutcome(target_probs=target_probs[d: d + k],
                                         recovery_ids=[int(t) for t in drawn[d: d + k]],
                                         bonus_id=int(drawn[drafts + j])))
            d += k
        return out
    return part, read


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
