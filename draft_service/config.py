"""The draft service's settings, apart from the service: `specd serve draft`'s
flags are built from them without importing torch (specdec/cli/serve_cmd.py)."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import opt

DEFAULT_PORT = 50052


@dataclass
class DrafterConfig:
    drafter: str = opt("model", "model: a draft LM; ngram: prompt lookup, no model", choices=("model", "ngram"))
    max_q_tokens: int = opt(32, "tokens kept in each sent proposal distribution q")
    ngram_min: int = opt(1, "ngram drafter: shortest suffix to match")
    ngram_max: int = opt(3, "ngram drafter: longest suffix to match")
    run_ahead: str = opt("auto", "model drafter: run a Propose's steps ahead on the device, each fed the step "
                         "before's tokens there and queued before the host reads them (auto: on a GPU)",
                         choices=("auto", "on", "off"))
