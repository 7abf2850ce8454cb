"""A draft's proposal q on the wire: common.proto's SparseDistribution, in
either of its two encodings.

A sampled round carries k proposals from the draft, through the
orchestrator, to the target: each a few dozen (token id, probability) pairs.
As the message's two lists, the draft built them from Python lists, the
orchestrator copied them, and the target read them back into lists, turned
them into tensors and checked them entry by entry: about 20 µs a proposal on
the target alone, warm (85 µs for a round of 4, 0.7 ms for a Verify of 8
sessions of 4), all of it on the round's path. The `packed` encoding carries
the same entries as raw little-endian memory: the draft writes its tensors'
bytes, the orchestrator passes them on, and the target checks all of an
item's proposals of one size together, a few array operations for all.

Which encoding a draft writes is its caller's choice (`ProposeRequest.packed_q`),
made only when the target that will read the proposals says it reads packed
ones (`ModelInfo.reads_packed_q`), so that services of either version work
together. Every reader here takes both. The checks are `validate_sparse`'s,
with its messages: a proposal that fails them is checked again by it alone.
"""
from __future__ import annotations

import struct
import sys
from collections.abc import Sequence

import numpy as np
import torch

from specdec.sampling import sparse
from specdec.sampling.sparse import SparseDist, sparse_problem, validate_sparse

IDS = np.dtype("<i4")
PROBS = np.dtype("<f4")
_WORD = np.dtype("<u4")  # an id or a probability: what a packed entry is made of, twice

# A proposal as received: `packed`'s bytes, (token_ids, probs) lists, or why it cannot be read.
Received = bytes | tuple[Sequence[int], Sequence[float]] | ValueError


def write(msg, dist: SparseDist, packed: bool) -> None:
    """Fill the SparseDistribution `msg` with `dist`'s entries, packed or as the lists."""
    if packed:
        msg.packed = pack(dist)
    else:
        ids, probs = dist.to_lists()
        msg.token_ids.extend(ids)
        msg.probs.extend(probs)


def pack(dist: SparseDist) -> bytes:
    """`dist`'s entries in the packed encoding (host tensors)."""
    return dist.token_ids.numpy().astype(IDS).tobytes() + dist.probs.numpy().astype(PROBS).tobytes()


def unpack(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, probabilities) of a packed proposal, read in place."""
    n = _entries(data)
    return np.frombuffer(data, IDS, n), np.frombuffer(data, PROBS, n, offset=4 * n)


def unpack_lists(data: bytes) -> tuple[list[int], list[float]]:
    """(token ids, probabilities) of a packed proposal as Python lists, as
    the message's lists would read (the probabilities' float32 values, exactly)."""
    n = _entries(data)
    view = memoryview(data)
    return _read(view[:4 * n], "i"), _read(view[4 * n:], "f")


def _read(data, kind: str) -> list:
    """The 4-byte words of `data` as Python numbers: int32 ("i") or float32 ("f")."""
    if _NATIVE_IS_WIRE:  # the memory's own reading is the wire's: no array machinery for a few dozen entries
        return memoryview(data).cast(kind).tolist()
    return np.frombuffer(data, IDS if kind == "i" else PROBS).tolist()


def _entries(data: bytes) -> int:
    if len(data) % 8:
        raise ValueError(f"packed sparse distribution has {len(data)} bytes, not 8 per entry "
                         "(a 4-byte token id and a 4-byte probability)")
    return len(data) // 8


_NATIVE_IS_WIRE = sys.byteorder == "little" and struct.calcsize("i") == 4 and struct.calcsize("f") == 4


def received(msg) -> Received:
    """A SparseDistribution as the target takes it from a Verify item."""
    if not msg.packed:
        return list(msg.token_ids), list(msg.probs)
    if len(msg.token_ids) or len(msg.probs):
        return ValueError("sparse distribution sets both its lists and `packed`: a writer sets one of them")
    return msg.packed


def entries(msg) -> tuple[list[int], list[float]]:
    """(token ids, probabilities) of a SparseDistribution of either encoding,
    as lists (ValueError for a packed field of a length no entries make)."""
    if msg.packed:
        return unpack_lists(msg.packed)
    return list(msg.token_ids), list(msg.probs)


def prob_of(msg, token_id: int) -> float:
    """q(x) from a SparseDistribution of either encoding, as `sparse.prob_of`
    reads the lists (the probability over the exactly rounded sum of all)."""
    if msg.packed:
        return sparse.prob_of(*unpack_lists(msg.packed), token_id)
    return sparse.prob_of(msg.token_ids, msg.probs, token_id)


def check_items(items: Sequence[tuple[Sequence[Received], Sequence[int]]],
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
    ids_all, probs_all = _read(data, "i"), _read(data, "f")
    for j, x in enumerate(drafted):
        at = 2 * n * j
        if sparse_problem(ids_all[at: at + n], probs_all[at + n: at + 2 * n], vocab_size, drafted_id=x) is not None:
            return None
    words = np.frombuffer(data, _WORD).reshape(len(blobs), 2, n)
    return SparseDist.rows(torch.from_numpy(words[:, 0].view(IDS).astype(np.int64)),
                           torch.from_numpy(words[:, 1].view(PROBS).astype(np.float32)))  # copies: native, writable


def _check_one(i: int, q: Received, drafted: int, vocab_size: int) -> SparseDist:
    try:
        if isinstance(q, ValueError):
            raise q
        if isinstance(q, bytes):
            ids, probs = unpack(q)
            q = ids.astype(np.int64), probs.astype(np.float32)  # copies: writable, native order
        return validate_sparse(q[0], q[1], vocab_size, drafted_id=drafted)
    except ValueError as exc:
        raise ValueError(f"draft_q[{i}]: {exc}") from None
