"""The target's checks of the proposals q a Verify brings (either encoding of
`specdec.sampling.q_wire`), and the `SparseDist`s it scores with.

The checks are `validate_sparse`'s, with its messages: a proposal that fails
them is checked again by it alone, so the error names it and says why.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.sampling import q_wire
from specdec.sampling.sparse import SparseDist, validate_sparse
from specdec.sampling.sparse_lists import sparse_problem


def check_items(items: Sequence[tuple[Sequence[q_wire.Received], Sequence[int]]],
                vocab_size: int) -> list[list[SparseDist] | ValueError]:
    """For each Verify item, given as (its q's, its drafted tokens), its
    proposals as SparseDists, each checked as `validate_sparse` checks one
    (q_i must give its drafted token x_i mass), or a ValueError naming the
    item's first bad one ("draft_q[i]: ..."). The packed proposals of one
    size, all items' together, are checked with a few array operations for
    all of them; any that fail, and those sent as lists, one by one."""
    found: list[list[SparseDist | None]] = [[None] * len(qs) for qs, _ in items]
    by_size: dict[int, list[tuple[int, int]]] = {}
    for a, (qs, drafted) in enumerate(items):
        assert len(qs) == len(drafted), (len(qs), len(drafted))
        for i, q in enumerate(qs):
            if type(q) is bytes and q and len(q) % 8 == 0:
                by_size.setdefault(len(q), []).append((a, i))
    for size, members in by_size.items():
        dists = _check_packed([items[a][0][i] for a, i in members], [items[a][1][i] for a, i in members],
                              size // 8, vocab_size)
        for (a, i), dist in zip(members, dists or ()):
            found[a][i] = dist
    out: list[list[SparseDist] | ValueError] = []
    for (qs, drafted), dists in zip(items, found):
        try:
            out.append([dist if dist is not None else _check_one(i, q, x, vocab_size)
                        for i, (dist, q, x) in enumerate(zip(dists, qs, drafted))])
        except ValueError as exc:
            out.append(exc)
    return out


def _check_packed(blobs: list[bytes], drafted: list[int], n: int, vocab_size: int) -> list[SparseDist] | None:
    """g packed proposals of n entries each, checked together; None when any
    fails a check (the caller then finds which, and why, one by one). The
    checks (`sparse_problem`) run on Python lists read off the bytes in one
    go (a few dozen entries each: array calls cost more, with the caches cold
    after the forward pass), the tensors are made once for all of them."""
    data = b"".join(blobs)
    ids_all, probs_all = q_wire.read_words(data, "i"), q_wire.read_words(data, "f")
    for j, x in enumerate(drafted):
        at = 2 * n * j
        if sparse_problem(ids_all[at: at + n], probs_all[at + n: at + 2 * n], vocab_size, drafted_id=x) is not None:
            return None
    words = np.frombuffer(data, q_wire.WORD).reshape(len(blobs), 2, n)
    return SparseDist.rows(torch.from_numpy(words[:, 0].view(q_wire.IDS).astype(np.int64)),
                           torch.from_numpy(words[:, 1].view(q_wire.PROBS).astype(np.float32)))  # copies: native, writable


def _check_one(i: int, q: q_wire.Received, drafted: int, vocab_size: int) -> SparseDist:
    try:
        if isinstance(q, ValueError):
            raise q
        if isinstance(q, bytes):
            ids, probs = q_wire.unpack(q)
            q = ids.astype(np.int64), probs.astype(np.float32)  # copies: writable, native order
        return validate_sparse(q[0], q[1], vocab_size, drafted_id=drafted)
    except ValueError as exc:
        raise ValueError(f"draft_q[{i}]: {exc}") from None
