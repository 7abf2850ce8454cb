"""A model service's per-call limits, apart from the service (which imports
torch), so that the command line can offer them as flags cheaply."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import opt
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS


@dataclass
class SessionLimits:
    """Per-call limits of a model service."""

    session_ttl_s: float = opt(300.0, "close sessions idle this long, seconds")
    max_draft_tokens: int = opt(DEFAULT_MAX_DRAFT_TOKENS, "largest num_draft_tokens of one Propose call or Verify item")
    max_verify_batch: int = opt(64, "target: sessions one Verify call may carry")
    max_sessions_per_caller: int = opt(0, "sessions one caller (certificate name under mutual TLS, else host) "
                                          "may hold open at once (0: no quota)")
