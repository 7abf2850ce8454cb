"""The draft's and the target's halves of the rejection sampler, on the
models' tensors: the draft's x_i drawn from its q_i, and the target's scoring
of a round's drafts (`score_drafts`, `score_many`), which returns O(k)
numbers a session. The words, the worked example and the orchestrator's
accept decisions are in `specdec.sampling.rejection`.

The recovered and bonus tokens are drawn where the logits are (the GPU, on a GPU
target), in float64 (`sparse.pick_rows`): only O(k) numbers cross to the host, in
one transfer for all the sessions of a batched Verify (`score_many`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.host_copy import to_device
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection import VerifyOutcome
from specdec.sampling.rng import Stream, uniform, uniforms
from specdec.sampling.sparse import SparseDist, densify_many, pick_rows, sample, sample_dense
from specdec.sampling.transform import argmax_tokens, logits_to_probs


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
        # A float32 softmax over a 152k vocabulary sums to 1 only within ~2e-5; target-only
        # decoding draws from p / sum(p) (pick_rows), so the accept test and the residual
        # use that p too, or the round's law would differ from it by as much (TV ~8e-6).
        # The residual max(0, p/s - q) is drawn from as s·max(0, p/s - q) = max(0, p - s·q):
        # one pass, no [D, V] division.
        mass = p_drafts.sum(dim=-1, keepdim=True)  # [D, 1] s, summed pairwise: within ~3e-8
        q = densify_many([q for job in jobs for q in job.draft_q], p.shape[-1], device)  # [D, V]
        residual = torch.addcmul(p_drafts, q, mass, value=-1.0).clamp_min(0.0)  # [D, V]
        no_mass = ~(residual > 0).any(dim=-1, keepdim=True)  # [D, 1]
        residual = torch.where(no_mass, p_drafts, residual)
        drawn, ok = pick_rows(torch.cat([residual, p_bonus]), us_recovery + us_bonus)  # [D + J] each
        # float64 holds every float32 p_i(x_i) and every token id exactly
        part = torch.cat([(p_drafts.gather(-1, x[:, None]) / mass)[:, 0].double(), drawn.double(), ok.double()])
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
