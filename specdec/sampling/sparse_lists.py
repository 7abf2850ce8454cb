"""A sparse proposal q as the wire gives it: two lists, token ids and
probabilities, read without tensors.

The orchestrator's accept test needs only q_i(x_i), and the target checks a
packed proposal's entries before it makes tensors of them; both are a few
dozen numbers, which plain Python reads faster than array calls (with the
caches cold after a forward pass). Keeping them here, apart from
`specdec.sampling.sparse` (the `SparseDist` tensors), lets the orchestrator
run without torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

SUM_TOLERANCE = 1e-3  # how far from 1 an untrusted q's probabilities may sum (`validate_sparse`)


def prob_of(token_ids: Sequence[int], probs: Sequence[float], token_id: int) -> float:
    """`SparseDist.from_lists(token_ids, probs).prob(token_id)` without
    building tensors: q(x) for the orchestrator's accept test, from the wire's
    float32 values. The sum is exactly rounded (math.fsum), so it may differ
    from the tensor sum in the last bit of a float64, far below anything the
    accept test can see."""
    ids = list(token_ids)
    if token_id not in ids:
        return 0.0
    ps = list(probs)
    return ps[ids.index(token_id)] / math.fsum(ps)


def sparse_problem(ids: list[int], ps: list[float], vocab_size: int, tol: float = SUM_TOLERANCE,
                   drafted_id: int | None = None) -> str | None:
    """What is wrong with a sparse distribution given as lists (`validate_sparse`'s
    checks, in its order), or None. A valid one costs a few passes of builtins."""
    if len(ids) != len(ps):
        return f"sparse distribution has {len(ids)} token ids but {len(ps)} probabilities"
    if not ids:
        return "sparse distribution is empty"
    if min(ids) < 0 or max(ids) >= vocab_size:
        token = next(t for t in ids if not 0 <= t < vocab_size)
        return f"sparse distribution has token id {token} outside [0, {vocab_size})"
    if len(set(ids)) != len(ids):
        return "sparse distribution has duplicate token ids"
    try:
        total = math.fsum(ps)  # NaN when one is; inf, or ValueError (inf - inf), when one is infinite
    except (ValueError, OverflowError):  # inf - inf; float64 values past float32's range
        total = math.nan
    # Every probability finite and >= 0 exactly when both hold (the wire's
    # values are float32: a sum of finite ones stays finite). A NaN fails the
    # first if min() returns it, else makes the sum NaN. One pass of builtins
    # instead of a comparison per entry in Python.
    if not (min(ps) >= 0.0 and math.isfinite(total)):
        return "sparse distribution has a negative, NaN or infinite probability"
    if abs(total - 1.0) > tol:
        return f"sparse distribution sums to {total:.6g}, not 1 (tolerance {tol})"
    if drafted_id is not None:
        try:
            if ps[ids.index(drafted_id)] > 0:
                return None
        except ValueError:  # not in the support
            pass
        return f"drafted token {drafted_id} has probability 0 under its own q"
    return None
