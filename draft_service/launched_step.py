"""One draft step once launched: the forward pass queued, its picks made
on the device and not yet read (`ModelDrafter._launch`, `_launch_ahead`).

It holds, per stream of the step, what the host needs to settle it: the
stream's index among the job's streams, its session, its `DraftRow` and which
row of the step's picks is its. A step launched ahead for several streams is
narrowed (`only`) to those that still want its token; the others' rows are
read with the rest (one transfer) and ignored. Picks that cannot be made or
read together are made row by row, so one row's fault stays with its stream.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specdec.host_copy import to_device
from specdec.sampling.draft_picks import DevicePicks, DraftPick, DraftRow, pick_drafts, pick_on_device

log = logging.getLogger(__name__)


def pick_alone(logits, row: DraftRow, max_q_tokens: int) -> DraftPick | Exception:
    try:
        return pick_drafts(logits, [row], max_q_tokens)[0]
    except Exception as exc:  # noqa: BLE001 - reported as this stream's error
        return exc


@dataclass
class LaunchedStep:
    """One launched draft step: per stream its result so far (None, or an
    error met before the pass); for the streams in the pass (`where`) their
    sessions, rows and picks (on the device until read). `rows_of`: which of
    the picks' rows are theirs (None: all, in order)."""

    results: list
    where: list = field(default_factory=list)
    sessions: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    picks: DevicePicks | list | None = None
    rows_of: list[int] | None = None
    # What the picks were made from (their rows, all of them, and logits), to
    # pick row by row if reading them fails.
    picked_rows: list = field(default_factory=list)
    logits: torch.Tensor | None = None
    max_q_tokens: int = 0

    def add(self, index: int, session, row: DraftRow) -> None:
        self.where.append(index)
        self.sessions.append(session)
        self.rows.append(row)

    def pick(self, logits: torch.Tensor, max_q_tokens: int, graphs=None) -> None:
        """The device half of the rows' picks (as a CUDA graph replay where
        `graphs`, a PickGraphs, has one); an unexpected failure, here or when
        they are read, is isolated row by row."""
        self.picked_rows, self.logits, self.max_q_tokens = list(self.rows), logits, max_q_tokens
        try:
            self.picks = pick_on_device(logits, self.rows, max_q_tokens, graphs)
        except Exception:  # noqa: BLE001 - unexpected: isolate it, row by row
            self.picks = self._one_by_one()

    def _one_by_one(self) -> list:
        return [pick_alone(self.logits[j: j + 1], row, self.max_q_tokens) for j, row in enumerate(self.picked_rows)]

    def start_copy(self) -> None:
        """Start bringing the picks to the host (a failure leaves it to `read`)."""
        if isinstance(self.picks, DevicePicks):
            try:
                self.picks.start_copy()
            except Exception:  # noqa: BLE001 - read() copies them then, or picks row by row
                log.exception("could not start copying a draft step's picks")

    def read(self) -> list:
        """The streams' picks, in `where` order (waits for the device)."""
        if isinstance(self.picks, DevicePicks):
            try:
                self.picks = self.picks.read()
            except Exception:  # noqa: BLE001 - unexpected: isolate it, row by row
                self.picks = self._one_by_one()
        return self.picks if self.rows_of is None else [self.picks[j] for j in self.rows_of]

    def tokens(self) -> torch.Tensor:
        """The streams' drafted ids, still on the device, in `where` order."""
        tokens = self.picks.tokens
        return tokens if self.rows_of is None else tokens[to_device(self.rows_of, tokens.device)]

    def only(self, wanted) -> "LaunchedStep":
        """This step for the streams `wanted(index)` says yes to; the others'
        rows are still read with the rest (one transfer) and ignored."""
        keep = [j for j, i in enumerate(self.where) if wanted(i)]
        if len(keep) == len(self.where):
            return self
        base = self.rows_of or list(range(len(self.where)))
        return LaunchedStep(self.results, [self.where[j] for j in keep], [self.sessions[j] for j in keep],
                            [self.rows[j] for j in keep], self.picks, [base[j] for j in keep], self.picked_rows,
                            self.logits, self.max_q_tokens)
