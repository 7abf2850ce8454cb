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
together. Every reader here takes both.

This module reads and writes the encodings, and imports no torch (the
orchestrator passes q's on and reads q_i(x_i) for its accept test); the
target's checks of what it receives, which make tensors, are in
`specdec.sampling.q_checks`.
"""
from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence

import numpy as np

from specdec.sampling import sparse_lists

IDS = np.dtype("<i4")
PROBS = np.dtype("<f4")
_ID = struct.Struct("<i")  # a token id as the packed encoding writes it
WORD = np.dtype("<u4")  # an id or a probability: what a packed entry is made of, twice

# A proposal as received: `packed`'s bytes, (token_ids, probs) lists, or why it cannot be read.
Received = bytes | tuple[Sequence[int], Sequence[float]] | ValueError


def write(msg, dist, packed: bool) -> None:
    """Fill the SparseDistribution `msg` with `dist`'s entries (a
    `specdec.sampling.sparse.SparseDist`), packed or as the lists."""
    if packed:
        msg.packed = pack(dist)
    else:
        ids, probs = dist.to_lists()
        msg.token_ids.extend(ids)
        msg.probs.extend(probs)


def pack(dist) -> bytes:
    """`dist`'s entries in the packed encoding (host tensors): as its maker
    packed them (`SparseDist.packed`), else packed now."""
    if dist.packed is not None:
        return dist.packed
    return pack_arrays(dist.token_ids.numpy(), dist.probs.numpy())


def pack_arrays(token_ids: np.ndarray, probs: np.ndarray) -> bytes:
    """Entries given as numpy arrays, in the packed encoding."""
    return token_ids.astype(IDS).tobytes() + probs.astype(PROBS).tobytes()


def unpack(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, probabilities) of a packed proposal, read in place."""
    n = _entries(data)
    return np.frombuffer(data, IDS, n), np.frombuffer(data, PROBS, n, offset=4 * n)


def unpack_lists(data: bytes) -> tuple[list[int], list[float]]:
    """(token ids, probabilities) of a packed proposal as Python lists, as
    the message's lists would read (the probabilities' float32 values, exactly)."""
    n = _entries(data)
    view = memoryview(data)
    return read_words(view[:4 * n], "i"), read_words(view[4 * n:], "f")


def read_words(data, kind: str) -> list:
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
    """q(x) from a SparseDistribution of either encoding, as `sparse_lists.prob_of`
    reads the lists (the probability over the exactly rounded sum of all)."""
    packed = msg.packed
    if packed:
        return packed_prob_of(packed, token_id)
    return sparse_lists.prob_of(msg.token_ids, msg.probs, token_id)


def packed_prob_of(data: bytes, token_id: int) -> float:
    """`sparse_lists.prob_of` of a packed proposal, read in place: the id's
    four bytes found in the ids' half (at an entry's start), the sum taken
    over the probabilities' memory. On the orchestrator's round path, once
    per draft: a third of unpacking both halves into lists first (0.75
    against 1.5 µs warm on the dev VM)."""
    n = _entries(data)
    if not -2**31 <= token_id < 2**31:
        return 0.0  # no int32: not among the entries
    needle = _ID.pack(token_id)
    at = data.find(needle, 0, 4 * n)
    while at > 0 and at % 4:  # the bytes straddle two ids: look on
        at = data.find(needle, at + 1, 4 * n)
    if at < 0:
        return 0.0
    probs = _probs_view(data, n)
    return probs[at // 4] / math.fsum(probs)


def _probs_view(data: bytes, n: int):
    """The probabilities of a packed proposal of `n` entries as a sequence of Python floats."""
    if _NATIVE_IS_WIRE:
        return memoryview(data)[4 * n:].cast("f")
    return np.frombuffer(data, PROBS, n, offset=4 * n).tolist()
