"""What one request asks for (`RequestSpec`) and what it cost
(`RequestStats`): the speculative loop (`orchestrator/speculation.py`) fills
the statistics, the servicer turns them into the GenerateStats of the
stream's last message."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    eos_ids: frozenset[int]
    speculate: bool
    request_id: str = ""
    pipeline: bool = False  # pipelined drafting (orchestrator/pipelining.py)
    # time.monotonic() by which the request must end; None: no deadline.
    deadline: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    fallback_rounds: int = 0
    plain_rounds: int = 0  # rounds the speculation gate had decode plainly (the draft was there)
    k_histogram: list[int] = field(default_factory=list)  # rounds per k used
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0  # time the request waited for session opens (prefills), re-opens included
    draft_time_s: float = 0.0  # time the request waited for drafts
    draft_compute_s: float = 0.0  # draft forward time the draft service reported (speculative drafting included)
    verify_time_s: float = 0.0
    target_compute_s: float = 0.0
    wire_bytes: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    round_trips: int = 0  # downstream RPCs: opens, proposes, verifies, closes
    pipelined_rounds: int = 0  # rounds whose drafts were made during the previous round's verify

    rejected_rounds: int = 0  # speculative rounds that ended in a rejection
    target_recoveries: int = 0  # target sessions re-opened after a failure
    # speculative rounds (k > 0) by drafts accepted: [j] = rounds that accepted exactly j
    acceptance_histogram: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)  # drafts verified in each round, in order
    _last_counted: int = field(default=0, repr=False)  # the last round's accepted drafts, as counted

    def record_round(self, k: int, accepted: int) -> None:
        """A round of k drafts, `accepted` of them accepted by the target."""
        self.rejected_rounds += accepted < k
        self.rounds += 1
        self.proposed += k
        self.accepted += accepted
        _bump(self.k_histogram, k)
        self.k_per_round.append(k)
        if k:
            _bump(self.acceptance_histogram, accepted)
        for i in range(accepted):
            _bump(self.accepted_per_position, i)
        self._last_counted = accepted

    def uncount_last_round(self, drafts: int) -> None:
        """The last round's last `drafts` accepted drafts are not the
        request's tokens (they follow an EOS it accepted, or a stop string):
        they leave the acceptance counts. `rejected_rounds` keeps the
        target's own decision."""
        last = self._last_counted
        drafts = min(drafts, last)
        if drafts <= 0:
            return
        kept = last - drafts
        self.accepted -= drafts
        for i in range(kept, last):
            self.accepted_per_position[i] -= 1
        if self.k_per_round and self.k_per_round[-1]:
            self.acceptance_histogram[last] -= 1
            _bump(self.acceptance_histogram, kept)
        for counts in (self.accepted_per_position, self.acceptance_histogram):
            while counts and not counts[-1]:  # as long as the counts the round would have made
                counts.pop()
        self._last_counted = kept

    def cut_last_round(self, dropped: int) -> None:
        """The last round's final `dropped` tokens are not the output (a stop
        string ended it earlier): they leave `completion_tokens`, and the
        accepted drafts among them leave the acceptance counts, as drafts
        after an EOS do. A round's tokens are its accepted drafts, then one
        token of the target's own (the bonus or the recovery): that one goes
        first."""
        self.completion_tokens -= dropped
        self.uncount_last_round(dropped - 1)

def _bump(counts: list[int], index: int) -> None:
    if len(counts) <= index:
        counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1
