"""Sparse proposal distributions and inverse-CDF sampling.

Rejection sampling is exact for ANY proposal q as long as every party uses the same
q, so the draft does not send its full distribution (151936 floats per position
for Qwen): it truncates q to its top few dozen tokens, renormalizes, samples from
that, and sends that exact truncated q. The truncated, renormalized `SparseDist`
IS the proposal q.

Normalization convention: the distribution a `SparseDist` stands for is
probs / sum(probs), the sum taken in float64 over the float32 values. `truncate`
makes that sum 1 to within 2**-25, so the division is nearly a no-op for our own
draft; a foreign drafter whose sum is off by up to `validate_sparse`'s tolerance
still gets exact treatment, because `sample`, `SparseDist.prob` and `densify` all
divide by the same sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.host_copy import to_device
# A q's checks on the wire's lists, shared with the target's checks of packed q's (q_checks).
from specdec.sampling.sparse_lists import SUM_TOLERANCE, sparse_problem
from specdec.sampling.transform import top_indices


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a few token ids; every other id has probability 0.

    Entries are in the sender's order (`truncate`: most likely first); the order
    matters for reproducing a draw from a uniform, not for the distribution.
    """

    token_ids: torch.Tensor  # [n] int64, distinct
    probs: torch.Tensor  # [n] float32, >= 0, summing to ~1 (see module docstring)
    # The same entries in the wire's packed encoding (q_wire.pack), when the
    # maker had them at hand as arrays (`with_packed`); None: packed on
    # demand. Not an init field, so `dataclasses.replace` never carries it
    # to other entries.
    packed: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        assert self.token_ids.dim() == 1 and self.token_ids.dtype == torch.int64
        assert self.probs.dim() == 1 and self.probs.dtype == torch.float32
        assert self.token_ids.shape == self.probs.shape

    @classmethod
    def from_lists(cls, token_ids: Sequence[int], probs: Sequence[float]) -> SparseDist:
        """Build from wire lists (no checks: use `validate_sparse` on untrusted input)."""
        return cls(
            torch.tensor(list(token_ids), dtype=torch.int64),
            torch.tensor(list(probs), dtype=torch.float32),
        )

    @classmethod
    def with_packed(cls, token_ids: torch.Tensor, probs: torch.Tensor, packed: bytes) -> SparseDist:
        """A SparseDist whose entries `packed` holds in the wire's packed encoding already."""
        dist = cls(token_ids, probs)
        object.__setattr__(dist, "packed", packed)
        return dist

    @classmethod
    def rows(cls, token_ids: torch.Tensor, probs: torch.Tensor) -> list[SparseDist]:
        """One SparseDist per row of token_ids [g, n] int64 and probs [g, n]
        float32 (views of them; no checks of the values), checked as a whole
        once rather than row by row."""
        assert token_ids.dim() == 2 and token_ids.dtype == torch.int64 and probs.dtype == torch.float32
        assert token_ids.shape == probs.shape, (tuple(token_ids.shape), tuple(probs.shape))
        out = []
        for ids, ps in zip(token_ids.unbind(0), probs.unbind(0)):
            dist = object.__new__(cls)  # each row's shape and dtypes are the whole's, checked above
            object.__setattr__(dist, "token_ids", ids)
            object.__setattr__(dist, "probs", ps)
            out.append(dist)
        return out

    def to_lists(self) -> tuple[list[int], list[float]]:
        """(token_ids, probs) for the wire; float32 values survive a proto float exactly."""
        return self.token_ids.tolist(), self.probs.tolist()

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def normalized(self) -> torch.Tensor:
        """probs / sum(probs) in float64 [n]: the distribution this stands for."""
        probs = self.probs.double()
        return probs / probs.sum()

    def prob(self, token_id: int) -> float:
        """q(token_id), normalized (see module docstring); 0.0 off the support.

        The orchestrator's q_i(x_i) for the accept test comes from here.
        """
        ids = self.token_ids.tolist()
        if token_id not in ids:
            return 0.0
        return self.normalized()[ids.index(token_id)].item()


def truncate(probs_row: torch.Tensor, max_tokens: int) -> SparseDist:
    """Keep the top max_tokens tokens of probs_row [V] (probabilities: each
    +0.0 or more) and renormalize: the proposal q.

    Fewer tokens are kept if fewer have nonzero mass; ties at the cut go to the
    lower token id. The float32 probabilities are made to sum to 1 as exactly as
    float32 allows (see `truncate_rows`). Returns CPU tensors.
    """
    assert probs_row.dim() == 1 and max_tokens >= 1, (tuple(probs_row.shape), max_tokens)
    ids, q = truncate_rows(probs_row[None], max_tokens)
    ids, q = ids[0].cpu(), q[0].cpu()
    assert q[0] > 0, "probs_row has no mass"
    return kept(ids, q)


def truncate_rows(probs: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`truncate` of every row of probs [B, V] (probabilities: each +0.0 or
    more), where they are (no transfer).

    Returns (ids [B, n], q [B, n] float32), n = min(max_tokens, V), most likely
    first. Per row: divide the kept values by their sum in float64, round to
    float32, then fold the rounding left over into the largest entry, so that
    the float64 sum of the float32 values is within half an ulp of that entry
    (<= 2**-25) of 1. Entries of mass 0 (fewer than n tokens have mass, or a
    mass below float32's range) come last with q = 0: `kept` drops them.
    Each row's arithmetic depends on that row alone, so a row truncates the
    same whatever it is batched with. A row without finite mass gives NaN or
    0 in q[:, 0]: the caller checks (no sync here).
    """
    assert probs.dim() == 2 and max_tokens >= 1, (tuple(probs.shape), max_tokens)
    n = min(max_tokens, probs.shape[-1])
    ids = top_indices(probs, n, nonnegative=True)  # [B, n], most likely first
    vals = probs.gather(-1, ids).to(torch.float64)  # [B, n]
    q = (vals / torch.cumsum(vals, dim=-1)[:, -1:]).float()  # [B, n]
    widened = q.double()
    fold = 1.0 - torch.cumsum(widened, dim=-1)[:, -1]  # [B]
    q[:, 0] = (widened[:, 0] + fold).float()
    return ids, q


def kept(ids: torch.Tensor, q: torch.Tensor) -> SparseDist:
    """The SparseDist of one truncated row (CPU tensors [n]): its entries of mass > 0."""
    mask = q > 0
    return SparseDist(ids[mask], q[mask])


def sample_rows(rows: torch.Tensor, us: Sequence[float]) -> list[int]:
    """For each row of weights rows [R, V] (any device), the index its uniform selects.

    Row r is treated as the distribution rows[r] / rows[r].sum(). Done where the
    rows are (no full-vocabulary row crosses to the host; one transfer of R
    integers comes back), in float64: the same weights and uniform give the
    same index on a given device whatever else is in the batch, since each
    row's cumulative sum depends on that row alone. Never returns an index of
    weight 0: the first index whose cumulative weight exceeds u * total cannot
    be one (its cumulative weight equals its predecessor's), and when
    u * total rounds up to the total (u within 2**-53 of 1) no index
    qualifies, so the last index of positive weight is used.
    """
    picked, ok = pick_rows(rows, us)
    host = torch.cat([picked, ok]).tolist()  # the one device-to-host transfer
    assert all(host[len(us):]), "rows without finite mass"
    return host[: len(us)]


def pick_rows(rows: torch.Tensor, us: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows` without the transfer: (picked [R] int64, ok [R] int64,
    0 where a row has no finite mass), on the rows' device."""
    assert rows.dim() == 2 and rows.shape[0] == len(us), (tuple(rows.shape), len(us))
    weights = rows.detach().to(torch.float64)  # [R, V]
    vocab = weights.shape[-1]
    cumulative = torch.cumsum(weights, dim=-1)  # [R, V]
    totals = cumulative[:, -1]  # [R]
    u = to_device(list(us), weights.device, torch.float64)  # without waiting for the work queued
    picked = torch.searchsorted(cumulative, (u * totals)[:, None], right=True)[:, 0]  # [R]
    last_positive = vocab - 1 - torch.argmax((weights > 0).flip(-1).to(torch.int8), dim=-1)
    # Past the last entry of mass only when u * total rounds up to the total (a
    # drawn index is never beyond it otherwise); finite by comparison, where
    # `isfinite` dispatches four operations (each a launch on a GPU).
    picked = torch.minimum(picked, last_positive)
    return picked, ((totals > 0) & (totals < math.inf)).long()


def sample(dist: SparseDist, u: float) -> int:
    """Inverse-CDF draw of a token id from dist, in its entry order, with uniform u."""
    return dist.token_ids[sample_rows(dist.probs[None], [u])[0]].item()


def sample_dense(probs_row: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw of a token id from a dense row [V], with uniform u."""
    assert probs_row.dim() == 1, tuple(probs_row.shape)
    return sample_rows(probs_row[None], [u])[0]


def densify(dist: SparseDist, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """The normalized dist as a dense float32 [vocab_size] on device."""
    return densify_many([dist], vocab_size, device)[0]


def densify_many(
    dists: Sequence[SparseDist], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Each normalized dist as a row of a dense float32 [len(dists), vocab_size] on device.

    One small host-to-device copy of the sparse entries, then a scatter on device.
    The dists are normalized as `SparseDist.normalized` does, those of one
    length together (a row sum of [m, n] adds each row as the sum of one [n]
    does), so a Verify of 8 sessions × 4 drafts costs a few host operations,
    not a few per dist.
    """
    dense = torch.zeros(len(dists), vocab_size, dtype=torch.float32, device=device)
    if not dists:
        return dense
    by_length: dict[int, list[int]] = {}
    for r, d in enumerate(dists):
        by_length.setdefault(len(d), []).append(r)
    rows, cols, vals = [], [], []
    for n, members in by_length.items():
        probs = torch.stack([dists[r].probs for r in members]).double()  # [m, n]
        vals.append((probs / probs.sum(dim=-1, keepdim=True)).float().flatten())
        cols.append(torch.stack([dists[r].token_ids for r in members]).flatten())
        rows.append(torch.tensor(members, dtype=torch.int64).repeat_interleave(n))
    # float64 holds every id (< 2**53) and every float32 value exactly
    staged = torch.stack([torch.cat(rows).double(), torch.cat(cols).double(), torch.cat(vals).double()])
    staged = staged.to(device, non_blocking=True)  # no sync on a GPU
    dense[staged[0].long(), staged[1].long()] = staged[2].float()
    return dense




def validate_sparse(
    token_ids: Sequence[int] | torch.Tensor,
    probs: Sequence[float] | torch.Tensor,
    vocab_size: int,
    tol: float = SUM_TOLERANCE,
    drafted_id: int | None = None,
) -> SparseDist:
    """Check an untrusted sparse distribution and build it; ValueError says what is wrong.

    drafted_id, if given, must lie in the support with probability > 0: a draft
    cannot have sampled a token its own q gives no mass.

    The checks run on Python lists: a q is a few dozen entries, and a dozen
    tensor ops per q cost more than the target's forward pass on a small model
    (they were most of what a sampled round spent beyond a greedy one).
    """
    ids_t = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    ps_t = torch.as_tensor(probs, dtype=torch.float32).reshape(-1)
    problem = sparse_problem(ids_t.tolist(), ps_t.tolist(), vocab_size, tol, drafted_id)  # ps: float32 values
    if problem is not None:
        raise ValueError(problem)
    return SparseDist(ids_t, ps_t)
