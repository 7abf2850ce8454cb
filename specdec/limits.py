"""The one limit on speculation: how many tokens one round may draft.

num_draft_tokens (k; the words are defined in `specdec.sampling.rejection`)
is the number of tokens one round drafts: one Propose call's count, one
Verify item's drafts. max_draft_tokens is its largest value, and means that
one thing everywhere: the draft service refuses a Propose for more, the
target service a Verify item with more, and the orchestrator drafts at most
the smallest of its own limit and both services' (each service advertises its
own in ModelInfo.max_draft_tokens). One verify scores k + 1 positions, so the
limit also bounds the target's work per item.

Pure: imports no grpc, so the core, the services and the orchestrator all
check through `check_num_draft_tokens` and say the same thing when it fails.
(`check_min_confidence` bounds the other number a Propose carries, the early
stop's threshold: a probability.)
"""
from __future__ import annotations

from specdec.errors import InvalidArgument

DEFAULT_MAX_DRAFT_TOKENS = 8


def check_num_draft_tokens(k: int, limit: int = DEFAULT_MAX_DRAFT_TOKENS, lowest: int = 1) -> None:
    """Raise InvalidArgument unless lowest <= k <= limit. `lowest` is 1 for a
    count the caller asked to draft (Propose, a policy's bounds) and 0 for
    drafts sent to be verified (a Verify item with none is a plain decode
    step)."""
    if not lowest <= k <= limit:
        raise InvalidArgument(f"num_draft_tokens must be in [{lowest}, {limit}], got {k}")


def check_min_confidence(value: float, name: str = "min_confidence") -> None:
    """Raise InvalidArgument unless 0 <= value <= 1: the confidence below
    which a round's drafting ends early (0: never), a probability. `name` is
    the field as the caller sent it (draft_min_confidence on Generate, a
    flag)."""
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise InvalidArgument(f"{name} must be in [0, 1], got {value}")
