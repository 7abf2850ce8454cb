"""The draft service's settings, apart from the service: `specd serve draft`'s
flags are built from them without importing torch (specdec/cli/serve_cmd.py)."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import opt

DEFAULT_PORT = 50052
# The most entries one proposal q may keep. A Verify carries up to
# --max-verify-batch (64) items of up to --max-draft-tokens (8) proposals:
# at 2048 entries of 8 bytes that is 8 MiB, within the 16 MiB message limit.
# A q of the whole 152k vocabulary is 1.2 MB: a batched Verify of two items
# of 8 drafts went over the limit, failed, and sent each of its requests
# through target recovery, again and again.
MAX_Q_TOKENS = 2048


@dataclass
class DrafterConfig:
    drafter: str = opt("model", "model: a draft LM; ngram: prompt lookup, no model", choices=("model", "ngram"))
    max_q_tokens: int = opt(32, f"tokens kept in each sent proposal distribution q (1 to {MAX_Q_TOKENS})")
    ngram_min: int = opt(1, "ngram drafter: shortest suffix to match")
    ngram_max: int = opt(3, "ngram drafter: longest suffix to match")
    run_ahead: str = opt("auto", "model drafter: run a Propose's steps ahead on the device, each fed the step "
                         "before's tokens there and queued before the host reads them (auto: on a GPU)",
                         choices=("auto", "on", "off"))

    def validate(self) -> "DrafterConfig":
        """Raise ValueError for settings no drafter can run with: an n-gram
        range that matches nothing (min past max, or 0) made a drafter that
        proposed nothing, every round, and cost a round trip each."""
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min and --ngram-max must satisfy 1 <= min <= max, "
                             f"got {self.ngram_min} and {self.ngram_max}")
        if not 1 <= self.max_q_tokens <= MAX_Q_TOKENS:
            raise ValueError(f"--max-q-tokens must be between 1 and {MAX_Q_TOKENS} (a Verify of several "
                             f"sessions must fit in one message), got {self.max_q_tokens}")
        return self
