"""The sampling math of speculative decoding: pure torch/numpy, no grpc.

- `params`: `SamplingParams` and their validation.
- `transform`: logits -> p or q (temperature, top-k, top-p), the same on both sides.
- `rng`: counter-based uniforms keyed by (seed, position, stream).
- `sparse`: the truncated proposal q (`SparseDist`) and inverse-CDF sampling;
  `sparse_lists` the same q read as the wire's two lists, without tensors.
- `rejection`: the rejection sampler's words (accepted, rejected, recovered and
  bonus tokens) and the orchestrator's accept decisions; `scoring` the draft's
  and the target's halves, on the models' tensors.
- `q_wire`: a proposal's two encodings on the wire; `q_checks` the target's
  checks of the proposals it receives.

The orchestrator imports only the modules that need no torch (`params`, `rng`,
`sparse_lists`, `rejection`, `q_wire`), so it runs without it. The names below
are re-exported lazily, each module loaded on first use, so that importing this
package does not import torch either.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "SamplingParams": "params",
    "RoundResult": "rejection", "VerifyOutcome": "rejection", "accept_greedy": "rejection",
    "accept_sampled": "rejection",
    "draw_draft": "scoring", "sample_token": "scoring", "score_drafts": "scoring",
    "Stream": "rng", "random_seed": "rng", "uniform": "rng", "uniforms": "rng",
    "SparseDist": "sparse", "densify": "sparse", "densify_many": "sparse", "sample": "sparse",
    "sample_dense": "sparse", "sample_rows": "sparse", "truncate": "sparse", "validate_sparse": "sparse",
    "prob_of": "sparse_lists",
    "argmax_tokens": "transform", "logits_to_probs": "transform", "top_indices": "transform",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
