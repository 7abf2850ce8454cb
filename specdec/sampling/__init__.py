"""The sampling math of speculative decoding: pure torch/numpy, no grpc.

- `params`: `SamplingParams` and their validation.
- `transform`: logits -> p or q (temperature, top-k, top-p), the same on both sides.
- `rng`: counter-based uniforms keyed by (seed, position, stream).
- `sparse`: the truncated proposal q (`SparseDist`) and inverse-CDF sampling.
- `rejection`: the rejection sampler; its docstring defines the vocabulary
  (accepted, rejected, recovered and bonus tokens).
"""

from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection import (
    RoundResult,
    VerifyOutcome,
    accept_greedy,
    accept_sampled,
    draw_draft,
    sample_token,
    score_drafts,
)
from specdec.sampling.rng import Stream, random_seed, uniform, uniforms
from specdec.sampling.sparse import (
    SparseDist,
    densify,
    densify_many,
    prob_of,
    sample,
    sample_dense,
    sample_rows,
    truncate,
    validate_sparse,
)
from specdec.sampling.transform import argmax_tokens, logits_to_probs, top_indices

__all__ = [
    "RoundResult",
    "SamplingParams",
    "SparseDist",
    "Stream",
    "VerifyOutcome",
    "accept_greedy",
    "accept_sampled",
    "argmax_tokens",
    "densify",
    "densify_many",
    "draw_draft",
    "logits_to_probs",
    "prob_of",
    "random_seed",
    "sample",
    "sample_dense",
    "sample_rows",
    "sample_token",
    "score_drafts",
    "top_indices",
    "truncate",
    "uniform",
    "uniforms",
    "validate_sparse",
]
