"""The draft's half of a step's sampling, for a whole batch of sessions at once.

After one batched forward pass of the draft model, every session in the
step needs its drafted token x and, when it samples, its proposal q (the
truncated `SparseDist`, sparse.py). `pick_drafts` makes them all where the
logits are, on the GPU for a GPU draft, and brings them to the host in ONE
transfer: the host syncs once per step, whatever the batch size, never
inside the step, and no full-vocabulary row crosses. It is two halves:
`pick_on_device` (nothing waits) and `DevicePicks.read` (the sync), so that a
drafter running its steps ahead can queue the next step, fed the picked
tokens where they are, before it waits for this one's picks.

Per row it does exactly what the one-row path does (`truncate`, then
`draw_draft` with the DRAFT uniform at the token's position): greedy rows
take the argmax, sampled rows are grouped by their sampling parameters (one
`logits_to_probs` per group), truncated by `truncate_rows` and drawn as
`pick_rows` draws. The uniforms depend on (seed, position) only, so the host
computes them before the step's result exists.

Each pick also carries the draft's confidence in it, its probability of the
token: q(x) for a sampled row, the model's softmax probability of the argmax
for a greedy one. A Propose ends early once the product of its drafts'
confidences falls below its `min_confidence` (draft_service/drafters.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.host_copy import to_device
from specdec.sampling import q_wire
from specdec.sampling.params import SamplingParams
from specdec.sampling.rng import Stream, uniform
from specdec.sampling.sparse import SparseDist, truncate_rows
from specdec.sampling.transform import argmax_tokens, logits_to_probs


@dataclass(frozen=True)
class DraftRow:
    """What a row of the step needs to be sampled."""

    params: SamplingParams
    seed: int
    position: int  # the drafted token's position in its session


@dataclass(frozen=True)
class DraftPick:
    token_id: int
    q: SparseDist | None  # None under greedy decoding
    confidence: float = 1.0  # the draft's probability of token_id (see the module docstring)


class NoMass(ValueError):
    """A row whose distribution has no finite mass (the model gave NaN or inf)."""


def pick_drafts(logits: torch.Tensor, rows: Sequence[DraftRow], max_q_tokens: int) -> list[DraftPick | NoMass]:
    """For logits [B, V] (row b the last logits of session b), each row's pick,
    or NoMass for a row that cannot be sampled (that row only)."""
    return pick_on_device(logits, rows, max_q_tokens).read()


@dataclass
class DevicePicks:
    """A step's picks where its logits are: `tokens` [B] (the drafted ids,
    what a chained step feeds the model next without the host reading them)
    and everything the host needs packed in one float64 tensor, read by
    `read()` in one transfer. `start_copy()` begins that transfer without
    waiting for it (CUDA: pinned memory and an event), so the host can queue
    more work on the device before it waits."""

    tokens: torch.Tensor
    packed: torch.Tensor
    batch: int
    sampled: list[tuple[list[int], int]]  # (rows of a sampled group, its q width)
    _host: torch.Tensor | None = None
    _ready: object = None  # the CUDA event after the copy, or None

    def start_copy(self) -> None:
        if self._host is not None:
            return
        if self.packed.device.type == "cuda":
            host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            host.copy_(self.packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.packed.device))  # the copy's device, not the current one
            self._host, self._ready = host, ready
        else:
            self._host = self.packed.cpu()

    def read(self) -> list[DraftPick | NoMass]:
        """Each row's pick: the one host sync of the step (a blocking copy,
        or the wait for the one `start_copy` began)."""
        if self._host is None:
            self._host = self.packed.cpu()
        elif self._ready is not None:
            self._ready.synchronize()
        # Read as numpy (the same memory): slicing and converting it costs a
        # fraction of torch's dispatch, several times a step.
        host, batch = self._host.numpy(), self.batch
        out: list[DraftPick | NoMass] = [DraftPick(t, None, c) for t, c in
                                         zip(host[:batch].astype(np.int64).tolist(), host[batch: 2 * batch].tolist())]
        at = 2 * batch
        for members, n in self.sampled:
            g = len(members)
            # Each row's entries of mass > 0 (`kept`), masked in numpy for the
            # whole group: torch's masking costs ~10 µs of dispatch a row.
            ids = host[at: at + g * n].astype(np.int64).reshape(g, n)
            q = host[at + g * n: at + 2 * g * n].astype(np.float32).reshape(g, n)
            ok = host[at + 2 * g * n: at + 2 * g * n + g].tolist()
            at += 2 * g * n + g
            mass = q > 0
            for j, i in enumerate(members):
                if not ok[j]:
                    out[i] = NoMass("the draft model's distribution has no finite mass at this position "
                                    "(NaN or inf logits)")
                    continue
                row = mass[j]
                row_ids, row_q = ids[j][row], q[j][row]
                # Packed for the wire while the entries are arrays: from the
                # tensors later it costs two more conversions a proposal, on
                # the reply's path (q_wire.pack).
                dist = SparseDist.with_packed(torch.from_numpy(row_ids), torch.from_numpy(row_q),
                                              q_wire.pack_arrays(row_ids, row_q))
                out[i] = DraftPick(out[i].token_id, dist, out[i].confidence)
        return out


def pick_on_device(logits: torch.Tensor, rows: Sequence[DraftRow], max_q_tokens: int,
                   graphs=None) -> DevicePicks:
    """The device half of `pick_drafts`: every row's token and what the host
    will read, computed where the logits are; nothing waits for the device.

    On a GPU each tensor operation here is a kernel launch, about what the
    arithmetic costs at these sizes, so the operations are few: a step whose
    rows share one sampling (the usual case) makes its tokens and
    confidences as they come out, with no scatter into batch-wide tensors.
    Such a step is one CUDA graph replay where `graphs` (a `PickGraphs`,
    pick_graphs.py) holds or can capture one for its shape: the same
    operations, so the same bits, for 5 launches instead of 40-60; a step
    of several samplings replays one graph per group, on its rows gathered.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    batch = len(rows)
    groups: dict[SamplingParams | None, list[int]] = {}  # None: the greedy rows
    for i, r in enumerate(rows):
        groups.setdefault(None if r.params.greedy else r.params, []).append(i)
    if len(groups) == 1:  # one sampling for the whole step: its tensors are the step's
        (params, members), = groups.items()
        tokens, packed, width = _group_picks(logits, params, max_q_tokens, rows, graphs)
        return DevicePicks(tokens, packed, batch, [] if params is None else [(members, width)])
    parts, sampled, packed = [], [], []
    for params, members in groups.items():
        index = _index(members, batch, logits.device)  # one copy of the group's rows to the device
        g = len(members)
        group_tokens, group_packed, width = _group_picks(logits[index], params, max_q_tokens,
                                                         [rows[i] for i in members], graphs)
        parts.append((index, group_tokens, group_packed[g: 2 * g]))
        if params is not None:
            sampled.append((members, width))
            packed.append(group_packed[2 * g:])  # the group's q ids, q's and flags, as `read` takes them
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    confidence = torch.empty(batch, dtype=torch.float64, device=logits.device)
    for index, group_tokens, group_confidence in parts:  # the groups cover every row once
        tokens[index] = group_tokens
        confidence[index] = group_confidence
    return DevicePicks(tokens, torch.cat([tokens.double(), confidence, *packed]), batch, sampled)


def _group_picks(logits: torch.Tensor, params: SamplingParams | None, max_q_tokens: int, rows: Sequence[DraftRow],
                 graphs) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`one_group` for rows sampling alike: a graph replay where `graphs` has
    or can capture one for their shape, else the operations one by one."""
    us = None if params is None else [uniform(r.seed, r.position, Stream.DRAFT) for r in rows]
    replayed = graphs.run(logits, params, max_q_tokens, us) if graphs is not None else None
    if replayed is not None:
        return replayed
    # the uniforms copied without waiting for the work queued
    return one_group(logits, params, max_q_tokens, None if us is None else to_device(us, logits.device, torch.float64))


def one_group(logits: torch.Tensor, params: SamplingParams | None, max_q_tokens: int,
              us: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The picks of a step whose rows all sample alike (`params` None: greedy),
    from its logits [B, V] and, when sampled, its uniforms [B] float64 on the
    logits' device: (tokens [B], what `DevicePicks.read` reads, the q's width).
    Fixed shapes and no host sync, so it can be captured (pick_graphs.py)."""
    if params is None:
        tokens, confidence = _greedy(logits)
        return tokens, torch.cat([tokens.double(), confidence]), 0
    tokens, confidence, ids, q, ok = _sampled(logits, params, max_q_tokens, us)
    return tokens, torch.cat([tokens.double(), confidence, ids.double().flatten(), q.flatten(), ok.double()]), \
        ids.shape[1]


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the argmax [g], its softmax probability [g] float64) of logits [g, V]."""
    chosen = logits.float()  # float32 whatever the logits' dtype (the argmax is the same)
    best = argmax_tokens(chosen)
    # softmax at the argmax: exp(logit there - logsumexp), reading the max already found
    confidence = torch.exp(chosen.gather(1, best[:, None])[:, 0] - torch.logsumexp(chosen, dim=-1)).double()
    return best, confidence


def _sampled(logits: torch.Tensor, params: SamplingParams, max_q_tokens: int,
             u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A group's draws from its truncated q (`truncate_rows`), with its rows'
    uniforms u [g] float64 on the logits' device: (tokens [g], q(token) [g]
    float64, the q's ids [g, n], q [g, n] float64, ok [g] bool: False for a
    row without finite mass).

    The draw is `pick_rows`' inverse-CDF draw, for rows it knows more of: a
    truncated row's entries of mass > 0 come first, so the last of them is
    found by counting, and the float64 q it reads is the one sent home."""
    ids, q = truncate_rows(logits_to_probs(logits, params), max_q_tokens)  # [g, n]
    weights = q.double()  # exactly the float32 values
    cumulative = torch.cumsum(weights, dim=-1)  # [g, n]
    totals = cumulative[:, -1]
    picked = torch.searchsorted(cumulative, (u * totals)[:, None], right=True)[:, 0]
    # u * total rounding up to the total (no index qualifies): the last entry of mass > 0
    last = (weights > 0).sum(dim=-1) - 1
    picked = torch.minimum(picked, last).clamp_(min=0)  # (0 for a row with no mass: refused below)
    first = weights[:, 0]  # the largest entry
    ok = (totals > 0) & (totals < math.inf) & (first > 0) & (first < math.inf)
    at = picked[:, None]
    return ids.gather(1, at)[:, 0], weights.gather(1, at)[:, 0], ids, weights, ok


def _index(members: list[int], batch: int, device) -> torch.Tensor | slice:
    if len(members) == batch:
        return slice(None)
    return to_device(members, device)  # without waiting for a chained step's forward

