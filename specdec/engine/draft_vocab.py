"""A trimmed draft vocabulary: the draft's output head over its most frequent tokens.

A drafted token costs one forward pass of the draft, and in a small model
the output matrix is a large share of it: Qwen2.5-0.5B's 151936 × 896 head is
136 M of its ~630 M parameters as run. Following EAGLE-3's 32k draft
vocabulary and FR-Spec, the draft may compute its logits over only the N
tokens that are most frequent in a corpus (`--draft-vocab N`); every other
token gets logit -inf, so probability 0.

Exact by construction: the draft's q is then its real distribution, zero
outside the subset, and sent exactly as before; rejection sampling is exact
for any q. A target token outside the subset is never proposed, so it can
only come as a recovered or bonus token: acceptance may fall, the output
distribution does not change.

The ranking is stored with the model as `vocab_rank.json` (`specd models
rank-vocab`): token ids by descending count over a corpus disjoint from the
benchmark's prompts. The subset always includes the model's end-of-sequence
ids, so the draft can propose the end of an answer.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from specdec.errors import InvalidArgument
from specdec.models.cache import locate
from specdec.models.synth import is_synth_name

log = logging.getLogger(__name__)

RANK_FILE = "vocab_rank.json"


class SubsetHead(nn.Module):
    """An output head that computes logits for `ids` only and returns them in
    the full vocabulary's columns, -inf elsewhere: [..., H] -> [..., V]."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor, vocab_size: int):
        super().__init__()
        ids = ids.to(device=head.weight.device, dtype=torch.long)
        bias = getattr(head, "bias", None)
        # An nn.Linear of its own, so what replaces linears (quantize.py) finds it.
        self.proj = nn.Linear(head.weight.shape[1], ids.numel(), bias=bias is not None,
                              device=head.weight.device, dtype=head.weight.dtype).requires_grad_(False)
        with torch.no_grad():
            self.proj.weight.copy_(head.weight.detach()[ids])  # [N, H]
            if bias is not None:
                self.proj.bias.copy_(bias.detach()[ids])
        self.register_buffer("ids", ids, persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        subset = self.proj(hidden)  # [..., N]
        full = subset.new_full((*subset.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, subset)


def restrict_head(model, ids: torch.Tensor) -> SubsetHead:
    """Replace model's output head by a SubsetHead over ids (in place)."""
    head = model.get_output_embeddings()
    vocab_size = int(head.weight.shape[0])
    subset = SubsetHead(head, ids, vocab_size)
    model.set_output_embeddings(subset)
    return subset


def subset_ids(ranked: Sequence[int], size: int, always: Iterable[int], vocab_size: int) -> torch.Tensor:
    """The first `size` ids of the ranking, the `always` ids included (they
    take the places of the last ranked ones), sorted."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    must = [i for i in dict.fromkeys(always) if 0 <= i < vocab_size]
    chosen = list(dict.fromkeys(must))
    for i in ranked:
        if len(chosen) >= size:
            break
        if 0 <= i < vocab_size and i not in must:
            chosen.append(i)
    if len(chosen) < size:  # a short ranking: fill with the lowest unranked ids
        seen = set(chosen)
        chosen += [i for i in range(vocab_size) if i not in seen][: size - len(chosen)]
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


def rank_tokens(token_streams: Iterable[Sequence[int]]) -> list[int]:
    """Token ids by descending count (ties: lower id first)."""
    counts: Counter[int] = Counter()
    for ids in token_streams:
        counts.update(ids)
    return [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def save_ranking(model_dir: str | Path, ranked: Sequence[int], fingerprint: str, corpus: str,
                 tokens_counted: int) -> Path:
    path = Path(model_dir) / RANK_FILE
    path.write_text(json.dumps({"tokenizer_fingerprint": fingerprint, "corpus": corpus,
                                "tokens_counted": tokens_counted, "ranked_ids": list(ranked)}))
    return path


def ranked_subset(model: str, info, size: int) -> torch.Tensor:
    """The `size` most frequent ids of the ranking stored with `model` (an
    engine's EngineInfo gives its tokenizer, EOS ids and usable ids). A
    synthetic model (random weights) has no frequencies to rank: its head
    keeps the lowest ids, which costs what any head of that size costs."""
    try:
        if is_synth_name(model):
            log.warning("%s: --draft-vocab %d on random weights: the head keeps ids 0.., for step costs only",
                        model, size)
            ranked = []
        else:
            ranked = load_ranking(locate(model)[0], info.tokenizer_fingerprint)
        return subset_ids(ranked, size, info.eos_token_ids, info.usable_vocab_size)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"--draft-vocab {size}: {exc}") from None


def load_ranking(model_dir: str | Path, fingerprint: str) -> list[int]:
    path = Path(model_dir) / RANK_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no ranked vocabulary at {path}: run `specd models rank-vocab` for this model first"
        )
    data = json.loads(path.read_text())
    if data.get("tokenizer_fingerprint") != fingerprint:
        raise ValueError(f"{path} was ranked for another tokenizer")
    return [int(i) for i in data["ranked_ids"]]
