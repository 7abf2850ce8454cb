"""A request's sampling parameters and their validation.

The same `SamplingParams` reach the draft (which turns its logits into q) and the
target (which turns its logits into p) so that both apply the identical transform;
see `specdec.sampling.transform`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


# The smallest temperature other than 0 (greedy). Below ~2.9e-39 a GPU's
# division (it multiplies by the float32 reciprocal, then infinite) turned
# every row into NaN, and a request failed INTERNAL; anything this close to 0
# is greedy decoding in all but name, and 0 says so.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into a distribution.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 means no limit.
    top_p: nucleus sampling, keep the smallest set of most likely tokens whose
        mass reaches top_p; 1.0 means no limit.

    Call `validate()` on anything that came from a user.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> SamplingParams:
        """Raise ValueError, with a message fit for the user, if a field is out of bounds.

        Returns self, so that `params = SamplingParams(...).validate()` reads well.
        """
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}"
            )
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(
                f"top_k must be an integer >= 0 (0 means no top-k limit), got {self.top_k!r}"
            )
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise ValueError(
                f"top_p must be in (0, 1] (1 means no nucleus limit), got {p!r}"
            )
        return self

    @classmethod
    def from_wire(cls, temperature: float, top_k: int, top_p: float) -> SamplingParams:
        """Build validated params from the fields of a `specdec.v1.SamplingParams` message.

        proto3 cannot tell an unset scalar from a zero, so the zero of each field
        must mean something harmless: temperature 0 is greedy (so an empty message
        asks for greedy decoding), top_k 0 is "no limit", and top_p 0, which would
        otherwise be invalid, is read as unset, i.e. 1.0 ("no limit").
        Raises ValueError as `validate()` does.
        """
        return cls(
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=1.0 if top_p == 0 else float(top_p),
        ).validate()
