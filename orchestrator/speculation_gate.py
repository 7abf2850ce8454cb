"""The speculation gate: whether the requests sharing one target replica's
verify batches speculate at all, or decode plainly, chosen by measuring both.

Why a gate above the per-request policy. Speculation trades draft compute for
fewer target passes. Under concurrency the target's batched step costs little
more for 8 rows than for 1 (its weights are read once either way), so plain
decoding of 8 streams already shares each weight read 8 ways, while 8 streams
of speculation add 8 streams of drafting and a verify batch of 8 * (k + 1)
rows. Past some number of streams plain decoding is faster (on the CPU
reference pair at 8 streams specdec ran at 0.59-0.82x of target-only). The
per-request goodput policy cannot see this: a request's verify cost is the
batch's, set mostly by the other requests' k. A request deciding alone to
decode plainly in a batch of plain rows would see a cheap verify, conclude
that drafting costs little, switch back, and the batch would oscillate. The
choice is the batch's, so it is made once per replica, here.

How (measured, model-free, in epochs). For a number of concurrent requests
(bucketed: 2, 3-4, 5-8, 9-16, ...) the gate keeps the aggregate rate, tokens
emitted per second by all requests on the replica, with speculation and with
plain decoding. An epoch runs one mode: it skips the first wave of rounds
after a switch (the draft catching up on the tokens decoded plainly, the
batch settling), then counts the tokens of `waves` rounds per request, over
at least `min_epoch_s` and a quarter of the other mode's last epoch (so a
mode of short rounds is not judged on a far shorter, noisier window). At its end the epoch's rate updates its mode's mean,
and the next mode is the better one; the other is re-measured for one epoch
once the better has run long enough that re-measuring costs at most
`probe_cost` of the throughput (below), and at once when it has no rate yet. A change of
bucket ends the epoch unmeasured and starts the new bucket's best mode
(speculation when nothing is known). Below `min_streams` requests the gate
stands aside and every request speculates, with its own policy's k.

What a re-measurement costs. An epoch of the slower mode, E seconds at a
rate r_slow against the faster's r_fast, loses E * (1 - r_slow / r_fast)
seconds' worth of the faster mode's tokens. Spread over the L seconds the
faster mode led since the last one, plus E, that is a share of the
throughput; the gate waits until it is at most `probe_cost`:

    L >= E * ((1 - r_slow / r_fast) / probe_cost - 1)

A mode far slower is re-measured rarely (plain decoding at a third of
speculation's rate, probe_cost 0.03: after 21 of its epochs' lengths); two
modes close in rate often, where a change of the lead is likeliest and
measuring the other costs least.

Exact either way: a plain round is a Verify with no drafts, which draws the
token a plain decode would (`orchestrator/speculation.py`); the draft catches
up on the next Propose through its keep_length.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

RATE_WEIGHT = 0.5  # EWMA weight of the newest epoch's rate
COMPARABLE_SHARE = 0.25  # an epoch lasts at least this share of the other mode's last one


def bucket(active: int) -> int:
    """The concurrency bucket of `active` requests: the next power of two
    (1, 2, 4 for 3-4, 8 for 5-8, ...)."""
    return 1 << max(0, active - 1).bit_length()


@dataclass
class BucketRates:
    """Aggregate tokens per second measured at one bucket, per mode."""

    rate: dict[bool, float] = field(default_factory=dict)  # speculate? -> tok/s (EWMA over epochs)
    epoch_s: dict[bool, float] = field(default_factory=dict)  # speculate? -> how long its last epoch took
    led_s: float = 0.0  # time run in the leading mode since the other was last measured

    def probe_after_s(self, probe_cost: float) -> float:
        """How long the faster mode leads before the slower is re-measured, so
        that re-measuring costs at most `probe_cost` of the throughput (module
        docstring)."""
        best = self.best()
        loss = 1.0 - self.rate[not best] / self.rate[best] if self.rate[best] > 0 else 0.0
        return self.epoch_s[not best] * max(0.0, loss / probe_cost - 1.0)

    def best(self) -> bool | None:
        """The faster mode (True: speculate); None before both are measured."""
        if len(self.rate) < 2:
            return None
        return self.rate[True] >= self.rate[False]


@dataclass(frozen=True)
class GateSettings:
    enabled: bool = True
    min_streams: int = 2  # below this many concurrent requests every request speculates
    waves: int = 3  # rounds per request an epoch counts
    min_epoch_s: float = 0.25  # and at least this long
    probe_cost: float = 0.03  # re-measuring the slower mode costs at most this share of the throughput
    stale_s: float = 10.0  # an epoch no request following the gate reported on for this long starts afresh


class SpeculationGate:
    """One per target replica (its verify batcher holds it). Requests ask
    `speculate(active)` before a round and report `record(...)` after it;
    `active` is the number of requests on the replica."""

    def __init__(self, settings: GateSettings = GateSettings(), clock: Callable[[], float] = time.perf_counter):
        self.settings = settings
        self.clock = clock
        self.buckets: dict[int, BucketRates] = {}
        self.mode = True  # speculate?
        self._bucket = 0  # 0: standing aside
        self._warm = 0  # rounds of the current epoch still to skip
        self._began = 0.0  # when the epoch began (its settling wave included)
        self._start: float | None = None  # when counting began
        self._last_gated = 0.0  # when a request that follows the gate last reported a round
        self._tokens = 0
        self._rounds = 0
        self.epochs = 0  # epochs measured, all buckets
        self.switches = 0

    def speculate(self, active: int) -> bool:
        """Whether a request that follows the gate drafts in the round it
        starts now (`would_speculate`), and the gate follows: it starts
        measuring `active`'s bucket in that mode if it was not."""
        answer = self.would_speculate(active)
        if self._applies(active):
            if self._bucket and not self._fresh():
                self._bucket = 0  # no request followed the gate for a while: what was counted is stale
            self._enter(bucket(active), active)
        return answer

    def would_speculate(self, active: int) -> bool:
        """What `speculate(active)` answers now, changing nothing: below the
        gate's threshold, always; in the bucket being measured (while fresh),
        its mode; elsewhere the bucket's best mode, speculation when not
        known. A request asks this before opening its draft session, which
        it then opens only once it is to speculate."""
        if not self._decides(active):
            return True
        b = bucket(active)
        if b == self._bucket and self._fresh():
            return self.mode
        rates = self.buckets.get(b)
        best = rates.best() if rates is not None else None
        return True if best is None else best

    def plain_now(self, active: int) -> bool:
        """Whether a request that follows the gate would decode plainly now."""
        return not self.would_speculate(active)

    def record(self, active: int, speculated: bool | None, tokens: int) -> None:
        """A round ended, emitting `tokens`. `speculated`: the mode the round
        ran in (what `speculate` said at its start); None for a request that
        does not follow the gate (target-only, or seeded sampling under a
        fixed k), whose rounds count in whatever epoch runs but neither start
        nor end one: without a request that follows the gate nothing is
        measured."""
        if not self._applies(active) or not self._bucket:
            return
        if bucket(active) != self._bucket:
            if speculated is not None:
                self._enter(bucket(active), active)
            return
        if speculated is not None and speculated != self.mode:
            return  # started before the switch
        now = self.clock()
        if speculated is not None:
            self._last_gated = now
        if self._warm:
            self._warm -= 1
            if not self._warm:
                self._start = now
            return
        self._tokens += tokens
        self._rounds += 1
        # Only a round of a request that follows the gate ends an epoch: rounds
        # of the others alone (they may outlast every gated request) measure nothing.
        if (speculated is not None and self._rounds >= self.settings.waves * active
                and now - self._start >= self._min_epoch_s()):
            self._end_epoch(self._tokens / (now - self._start), active, now)

    def _decides(self, active: int) -> bool:
        """Whether the gate decides for `active` requests (else every request speculates)."""
        return self.settings.enabled and active >= self.settings.min_streams

    def _fresh(self) -> bool:
        """Whether a request that follows the gate reported on the epoch lately."""
        return self.clock() - self._last_gated <= self.settings.stale_s

    def _applies(self, active: int) -> bool:
        """`_decides`, dropping what was being measured when it does not."""
        if self._decides(active):
            return True
        if self._bucket:  # standing aside from now on: what was being measured is dropped
            self._bucket, self.mode = 0, True
        return False

    def _enter(self, b: int, active: int) -> None:
        """Start `b`'s best mode (speculation when it is not known)."""
        if b == self._bucket:
            return
        self._bucket = b
        best = self.buckets.setdefault(b, BucketRates()).best()
        self._start_epoch(True if best is None else best, active, self.clock(), settle=True)

    def _start_epoch(self, mode: bool, active: int, now: float, settle: bool = False) -> None:
        """Run `mode` from now; after a switch (or with `settle`: the batch's
        make-up is changing) the first wave of rounds is not counted."""
        switched = mode != self.mode
        self.switches += switched
        self.mode = mode
        self._began = self._last_gated = now
        self._warm = active if switched or settle else 0
        self._start = None if self._warm else now
        self._tokens = self._rounds = 0

    def _min_epoch_s(self) -> float:
        """An epoch's shortest length: the setting, and a share of the other
        mode's last epoch, so that a mode of short rounds (plain decoding) is
        not judged on a window much shorter, hence noisier, than the other's."""
        other = self.buckets[self._bucket].epoch_s.get(not self.mode, 0.0)
        return max(self.settings.min_epoch_s, COMPARABLE_SHARE * other)

    def _end_epoch(self, rate: float, active: int, now: float) -> None:
        self.epochs += 1
        rates = self.buckets[self._bucket]
        old = rates.rate.get(self.mode)
        rates.rate[self.mode] = rate if old is None else old + RATE_WEIGHT * (rate - old)
        rates.epoch_s[self.mode] = now - self._began  # its settling wave included: what a probe costs
        best = rates.best()
        log.info("speculation gate, %d requests (bucket %d): %s epoch %.2f tok/s over %.2f s (%d rounds); "
                 "means: %s", active, self._bucket, _name(self.mode), rate, now - self._start, self._rounds,
                 ", ".join(f"{_name(m)} {r:.2f}" for m, r in sorted(rates.rate.items(), reverse=True)))
        if best is None:  # the other mode was never measured here
            rates.led_s = 0.0
            self._start_epoch(not self.mode, active, now)
            return
        if best == self.mode:
            rates.led_s += now - self._began
            if rates.led_s >= rates.probe_after_s(self.settings.probe_cost):
                rates.led_s = 0.0
                self._start_epoch(not best, active, now)
                return
        self._start_epoch(best, active, now)

    def describe(self) -> dict:
        """For logs and tests: the mode and each bucket's rates."""
        return {"speculate": self.mode, "bucket": self._bucket, "epochs": self.epochs, "switches": self.switches,
                "rates": {b: {_name(m): round(r, 3) for m, r in br.rate.items()}
                          for b, br in sorted(self.buckets.items())}}


def _name(mode: bool) -> str:
    return "speculate" if mode else "plain"
