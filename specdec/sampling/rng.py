"""Counter-based randomness: every uniform is a pure function of (seed, position, stream).

No generator carries state, so a seeded request draws the same numbers whatever it
was batched with, on whichever machine or device, and no code ever reseeds
anything. Keying:

- seed: the request's uint64 seed. 0 is a seed like any other; an unseeded request
  gets one from `random_seed()` once, when it is admitted.
- position: the absolute index, in the request's token sequence (prompt
  included), of the token being decided. A drafted token x_i, the decision to
  accept it, and the recovered token that replaces it all share x_i's position;
  the bonus token sits at the position after the last draft.
- stream: which decision at that position (`Stream`), so that the draft's choice,
  the accept test and the replacements are independent of one another.

Why reusing a position across rounds is safe: a round's emitted tokens depend only
on the uniforms at positions up to the last emitted one, and the next round starts
at the position after it. Uniforms at later positions that a rejected round drew
(drafts and recoveries that were thrown away) did not influence what was emitted.

The hash is SplitMix64 (Steele, Lea, Flood 2014) used as a counter-based generator:
key = mix64(seed ^ SEED_SALT), and the uniform for counter c = 4 * position + stream
is the top 53 bits of mix64(key + (c + 1) * GOLDEN_GAMMA), i.e. output c of a
SplitMix64 generator whose state starts at key. The constants below are part of
the reproducibility contract: changing them changes every seeded request's output.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from enum import IntEnum


class Stream(IntEnum):
    """Which random decision at a position. Values are part of the contract."""

    DRAFT = 0  # the draft samples x_i from q_i
    ACCEPT = 1  # the orchestrator's accept test for x_i
    RECOVERY = 2  # the target's recovered token for x_i, from norm(max(0, p_i - q_i))
    BONUS = 3  # the target's bonus token from p_{k+1}; also plain decoding


_NUM_STREAMS = 4
_MAX_POSITION = 2**62  # 4 * position + stream must fit in 64 bits
_MASK = 2**64 - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_SEED_SALT = 0x5EC0DEC0DE5EED00


def _mix64(z: int) -> int:
    """SplitMix64's finalizer, a bijection on uint64 (Python ints, masked to 64 bits)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniforms(seed: int, positions: Sequence[int], stream: Stream) -> list[float]:
    """Uniforms in [0, 1), with 53-bit resolution, one per position.

    Pure Python integers: a round needs a handful, for which this beats any array
    library, and the arithmetic is the same on every machine.
    """
    key = seed_key(seed)
    return [keyed_uniform(key, position, stream) for position in positions]


def seed_key(seed: int) -> int:
    """The generator's key for `seed` (`keyed_uniform`): made once, for a
    caller that draws its uniforms one at a time, as it needs them."""
    if not 0 <= seed <= _MASK:
        raise ValueError(f"seed must be an unsigned 64-bit integer, got {seed}")
    return _mix64(seed ^ _SEED_SALT)


def keyed_uniform(key: int, position: int, stream: Stream) -> float:
    """`uniform(seed, position, stream)` for key = `seed_key(seed)`."""
    assert 0 <= position < _MAX_POSITION, position
    assert 0 <= stream < _NUM_STREAMS, stream
    bits = _mix64((key + (position * _NUM_STREAMS + stream + 1) * _GOLDEN_GAMMA) & _MASK)
    return (bits >> 11) * 2.0**-53


def uniform(seed: int, position: int, stream: Stream) -> float:
    """One uniform in [0, 1) for (seed, position, stream); see the module docstring."""
    return uniforms(seed, (position,), stream)[0]


def random_seed() -> int:
    """A fresh uint64 seed for a request that did not bring one."""
    return secrets.randbits(64)
