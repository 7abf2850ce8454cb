"""The client's model of a fuzzed service's sessions (`Sim`: each one's
length and whether it is greedy), from which the fuzzer (services.py)
predicts whether a call must succeed or must be refused (`Expect`) and what
length a success must report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.fuzz.oracle import Expect
from specdec.fuzz.system import MAX_CONTEXT, USABLE_VOCAB
from specdec.sampling.params import MIN_TEMPERATURE
from specdec.v1 import common_pb2


@dataclass
class SimSession:
    length: int | None  # None: unknown (after calls sent at once)
    greedy: bool


@dataclass
class Sim:
    """What the client knows of the service's sessions."""

    limit: int
    open: dict[str, SimSession] = field(default_factory=dict)


def sampling_valid(s: common_pb2.SamplingParams) -> bool:
    """Whether the contract accepts these sampling parameters."""
    t, p = s.temperature, s.top_p
    return (math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE) and s.top_k >= 0
            and (p == 0 or (not math.isnan(p) and 0 < p <= 1)))


def ids_ok(ids, usable: int = USABLE_VOCAB) -> bool:
    """Whether every id is in the usable vocabulary."""
    return all(0 <= t < usable for t in ids)


def cut_and_append(session: SimSession | None, keep: int | None, append, extra: int, need: int,
                   usable: int = USABLE_VOCAB):
    """(Expect, new length before the extra tokens) of a call that cuts to keep,
    appends, then adds `extra` tokens and needs `need` tokens before its first logit."""
    if session is None:
        return Expect.FAIL, None
    if session.length is None:
        return Expect.ANY, None
    kept = session.length if keep is None else keep
    if keep is not None and not 0 <= keep <= session.length:
        return Expect.FAIL, None
    if not ids_ok(append, usable):
        return Expect.FAIL, None
    new = kept + len(append)
    if new > MAX_CONTEXT or new < need or new + extra > MAX_CONTEXT:
        return Expect.FAIL, None
    return Expect.OK, new
