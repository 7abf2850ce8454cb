"""Projected speedups from measured round costs, at acceptances the user gives.

A pair of random-weight models (`specd models synth`) has real step costs
but no acceptance worth the name, so `specd bench` measures the costs and
projects the speedup at assumed per-draft acceptances α. Every figure it
prints from here is labelled *projected*. The formulas use measured numbers
only:

    E(α, k)  = (1 − α^(k+1)) / (1 − α)        expected tokens per round
    t_d      = the draft's compute per drafted token
    t_c      = the rest of one Propose call (its wire and the draft service's
               loop), paid once a round that drafts (analysis.draft_cost_split)
    t_v(k)   = one verify of k + 1 tokens (the Verify RPC)
    o        = the rest of a round: round wall time − t_v − the Propose call
               (the orchestrator's own work)

- **one GPU** (both models on one device, rounds strictly sequential):
  cost = t_c + k·t_d + t_v(k) + o.
- **separate GPUs, pipelined drafting** (the rule `orchestrator/pipelining`
  implements): while the target verifies round r, the draft already makes
  k + 1 tokens as if all k drafts will be accepted. When round r is fully
  accepted and its bonus equals the first token drafted ahead (probability
  h = α^(k+1), taking the bonus match as one more acceptance), round r + 1
  sends no Propose and costs max(t_v(k) + o, t_c + (k+1)·t_d); otherwise it
  costs t_c + k·t_d + t_v(k) + o as without pipelining:
  cost = h · max(t_v + o, t_c + (k+1)·t_d) + (1 − h) · (t_c + k·t_d + t_v + o).

The projected rate is E / cost in the steady state of a long request. A
request of n tokens pays its session opens once (p, the prefill: model
time, which a round's o leaves out) and its tail too: the loop drafts only
k' = min(k, remaining − 1) tokens in a round, so a short request makes fewer
tokens per round than E (k = 4 at α = 1 takes rounds of 5, 5, 5 and 1 for 16
tokens: 4 per round, not 5). `request_time` follows that rule exactly, by
dynamic programming over the tokens still to make, and `specd bench`
projects for the mean request length of its own run. The projected speedup
divides the rate by the measured target-only rate of the same run. The same formulas at the
*measured* acceptance of a real pair give the figure that checks them
(`check_row`): they should land within ±10% of the measured speedup.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

LAYOUTS = ("one-gpu", "two-gpus-pipelined")


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k) = (1 − α^(k+1)) / (1 − α); k + 1 at α = 1."""
    assert 0.0 <= alpha <= 1.0 and k >= 0, (alpha, k)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class RoundCosts:
    """Measured costs of rounds of one k, in seconds."""

    k: int
    t_draft: float  # per drafted token
    t_verify: float  # one verify of k + 1 tokens
    overhead: float  # per round, outside both models
    t_draft_call: float = 0.0  # per Propose call, beyond its tokens (0: counted in t_draft)
    prefill: float = 0.0  # per request: its session opens (model time), paid once, not per round

    def sequential(self, k: int | None = None) -> float:
        """A round drafting k tokens (default: this k), then verifying them;
        a round of k = 0 makes no Propose call."""
        k = self.k if k is None else k
        return (self.t_draft_call if k else 0.0) + k * self.t_draft + self.t_verify + self.overhead

    def after_hit(self, k: int | None = None) -> float:
        """A round whose drafts were made ahead during the previous verify."""
        k = self.k if k is None else k
        return max(self.t_verify + self.overhead, self.t_draft_call + (k + 1) * self.t_draft)


def round_cost(costs: RoundCosts, alpha: float, layout: str) -> float:
    if layout == "one-gpu":
        return costs.sequential()
    if layout == "two-gpus-pipelined":
        hit = alpha ** (costs.k + 1)
        return hit * costs.after_hit() + (1.0 - hit) * costs.sequential()
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def request_time(costs: RoundCosts, alpha: float, layout: str, n: int) -> float:
    """Expected seconds to make n tokens with rounds of k' = min(k, remaining − 1) drafts.

    A round of k' drafts accepts j < k' of them with probability α^j (1 − α)
    and all k' with probability α^k'; it makes j + 1 tokens either way. With
    pipelining, a fully accepted round whose bonus also matches (one more
    factor α) lets the next round start from drafts made ahead.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    assert n >= 1 and 0.0 <= alpha <= 1.0, (n, alpha)
    pipelined = layout == "two-gpus-pipelined"
    # time[m] = (expected seconds for m tokens after a miss, after a hit)
    time: list[tuple[float, float]] = [(0.0, 0.0)]
    for m in range(1, n + 1):
        k = min(costs.k, m - 1)
        rest = 0.0
        for j in range(k + 1):
            p = alpha ** j * ((1.0 - alpha) if j < k else 1.0)
            miss, hit = time[m - j - 1]
            rest += p * (alpha * hit + (1.0 - alpha) * miss if pipelined and j == k else miss)
        after_hit = costs.after_hit(k) if pipelined else costs.sequential(k)
        time.append((costs.sequential(k) + rest, after_hit + rest))
    return costs.prefill + time[n][0]


def projected_rate(costs: RoundCosts, alpha: float, layout: str, request_tokens: int | None = None) -> float:
    """Projected tokens/s of one stream: in the steady state, or over requests
    of request_tokens tokens."""
    if request_tokens:
        return request_tokens / request_time(costs, alpha, layout, request_tokens)
    return expected_tokens(alpha, costs.k) / round_cost(costs, alpha, layout)


@dataclass(frozen=True)
class Projection:
    alpha: float
    layout: str
    k: int  # the measured k that projects best
    tokens_per_s: float
    speedup: float  # over the measured target-only rate


def best_projection(measured: Sequence[RoundCosts], alpha: float, layout: str,
                    target_only_tokens_per_s: float, request_tokens: int | None = None) -> Projection:
    """The k (among those measured) with the highest projected rate."""
    assert measured and target_only_tokens_per_s > 0
    best = max(measured, key=lambda c: (projected_rate(c, alpha, layout, request_tokens), -c.k))
    rate = projected_rate(best, alpha, layout, request_tokens)
    return Projection(alpha, layout, best.k, rate, rate / target_only_tokens_per_s)


def projection_table(measured: Sequence[RoundCosts], alphas: Iterable[float],
                     target_only_tokens_per_s: float, request_tokens: int | None = None) -> list[Projection]:
    return [best_projection(measured, a, layout, target_only_tokens_per_s, request_tokens)
            for a in alphas for layout in LAYOUTS]


def check_row(costs: RoundCosts, measured_alpha: float, measured_tokens_per_s: float,
              target_only_tokens_per_s: float, layout: str = "one-gpu", request_tokens: int | None = None) -> dict:
    """The projection at the measured acceptance beside the measured speedup:
    how far the formula is from reality on a pair whose acceptance is real."""
    projected = projected_rate(costs, measured_alpha, layout, request_tokens) / target_only_tokens_per_s
    measured = measured_tokens_per_s / target_only_tokens_per_s
    return {"k": costs.k, "alpha": measured_alpha, "layout": layout, "request_tokens": request_tokens,
            "projected_speedup": projected,
            "measured_speedup": measured, "error": projected / measured - 1.0}
