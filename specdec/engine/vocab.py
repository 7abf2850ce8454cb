"""Which token ids a model may read and emit: its usable vocabulary.

A model's embedding and output matrices often have more rows than its
tokenizer has tokens, rounded up for fast kernels: Qwen2.5-0.5B has 151936
rows, Qwen2.5-7B 152064, and both use one tokenizer of 151665 tokens. The rows
beyond the tokenizer are padding, but they hold weights (never trained, or
random in a test model), so their logits are finite and a sampler could pick
one: an id no text stands for, and one the other model of a pair may have no
row for.

So the engine masks every logit column >= the usable vocabulary size to -inf
once, as the forward pass returns (`mask_padding_`), before any use: greedy
argmax, the draft's q, the target's p, recovery and bonus draws. It also
refuses input ids >= that size (INVALID_ARGUMENT). Two models that share a
tokenizer then read and emit exactly the same ids, whatever their padding.

usable size = min(rows, ids the tokenizer knows) with a tokenizer; without
one, min(rows, the family's token count) for a model that names its family's
ids (an `IdSpace`: a synthetic Qwen2.5 with no tokenizer cached), and the rows
otherwise (tiny test models: there the ids are all there is).

A GGUF pads its tokenizer too: llama.cpp's converter fills the ids up to the
row count with placeholder tokens spelled "[PAD<id>]" (a Qwen2.5 GGUF has
[PAD151665]..[PAD151935]), and transformers loads them as ordinary entries.
They are not tokens of the tokenizer: `known_vocab` leaves them out, so a
converted GGUF and the original tokenizer have the same usable size and the
same fingerprint.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

_GGUF_PLACEHOLDER = re.compile(r"\[PAD(\d+)\]")


def known_vocab(tokenizer) -> dict[str, int]:
    """The tokenizer's token -> id map without GGUF placeholder tokens."""
    vocab = tokenizer.get_vocab()
    return {token: idx for token, idx in vocab.items() if not _is_placeholder(token, idx)}


def _is_placeholder(token: str, idx: int) -> bool:
    if not token.startswith("[PAD"):  # the fast path for almost every token
        return False
    match = _GGUF_PLACEHOLDER.fullmatch(token)
    return match is not None and int(match.group(1)) == idx


def ships_tokenizer(where: str, gguf_file: str | None) -> bool:
    """Whether a model source has tokenizer files. transformers 5 builds a
    Qwen2 tokenizer of one token for a directory without any; that is no
    tokenizer, and would make the usable size 1. A GGUF and a hub id: True
    (transformers decides)."""
    path = Path(where)
    if gguf_file or not path.is_dir():
        return True
    return any(path.glob("tokenizer*")) or any((path / name).is_file() for name in _TOKENIZER_FILES)


_TOKENIZER_FILES = ("vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


def known_token_count(tokenizer) -> int:
    """One past the largest id the tokenizer has a real token for."""
    ids = known_vocab(tokenizer).values()
    return max(ids) + 1 if ids else 0


@dataclass(frozen=True)
class IdSpace:
    """The token ids of a model family, for a model that has the family's
    architecture but not its tokenizer (models/synth.py): ids [0, size) mean
    what the family's tokenizer says, the rows beyond are padding. Two models
    of one family then pair without a tokenizer, whatever their padding."""

    family: str
    size: int

    def fingerprint(self) -> str:
        return f"untokenized-{self.family}-{self.size}"


def usable_size(rows: int, tokenizer, id_space: IdSpace | None = None) -> int:
    """Ids [0, n) a model with `rows` output rows may read and emit."""
    if tokenizer is not None:
        return min(rows, known_token_count(tokenizer))
    return min(rows, id_space.size) if id_space else rows


def usable_size_of_directory(model_dir: str, rows: int) -> int:
    """The usable size of a saved model with `rows` output rows: its
    tokenizer's, when the directory ships one."""
    if not ships_tokenizer(model_dir, None):
        return rows
    from transformers import AutoTokenizer

    try:
        return usable_size(rows, AutoTokenizer.from_pretrained(model_dir))
    except (OSError, ValueError):
        return rows


def mask_padding_(logits: torch.Tensor, usable: int) -> torch.Tensor:
    """Set logits[..., usable:] to -inf in place and return logits [..., V].

    A no-op when nothing is padding (usable >= V). The engine's logits are
    inference tensors, which may only be written in inference mode.
    """
    if usable < logits.shape[-1]:
        with torch.inference_mode():
            logits[..., usable:] = float("-inf")
    return logits
