"""Synthetic models: random weights in the real architectures, to measure speed
without the weights.

A forward pass costs the same whatever its weights hold, so a model built from
a real config with random weights has the real model's step cost, KV bytes and
memory; a pair of them has the real pair's round cost. What random weights do
not give is the acceptance rate (a random draft agrees with a random target by
chance only; a pair of the same name is identical, so it accepts everything):
take acceptance from real weights.

    specd models synth qwen2.5-7b --out DIR [--dtype bfloat16] [--device cuda]
    specd serve target --model synth:qwen2.5-7b --device cuda     # built at start-up

The tokenizer: the Qwen2.5 models share one, so a synthetic Qwen2.5 carries
the one of a cached catalog model that has it (`specd models fetch` gets one),
and without one, none. With it, the 0.5B (151936 rows) may draft for the 7B
(152064 rows): the orchestrator pairs models by tokenizer, and each engine
emits only the ids the tokenizer knows (engine/vocab.py). Without it, a
synthetic model still names its family's ids (`id_space`: the Qwen2.5
tokenizer's 151665), so the pair still pairs, on token-id prompts (a GPU
machine has no model cache).

Importing this module does not import torch or transformers.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from specdec.models.cache import model_dir, read_manifest
from specdec.models.catalog import QWEN_CODER_05B, QWEN_CODER_15B, ModelNotFoundError

log = logging.getLogger(__name__)

PREFIX = "synth:"
MARKER_NAME = "specdec-synth.json"
# Weights are drawn from this seed, so two builds of one name are the same model.
SEED = 0

# Tokens of each family's tokenizer: ids a synthetic model reads and emits
# without one (engine/vocab.py's IdSpace).
FAMILY_TOKENS: Mapping[str, int] = MappingProxyType({"qwen2.5": 151665})

# Catalog models whose tokenizer a synthetic model of the family may carry.
TOKENIZER_DONORS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"qwen2.5": (QWEN_CODER_05B.name, QWEN_CODER_15B.name)}
)


@dataclass(frozen=True)
class SynthSpec:
    """One architecture: the numbers of its transformers config (Qwen2)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    # Embedding and output rows; beyond the tokenizer's tokens they are padding.
    vocab_rows: int
    tied_embeddings: bool
    # Whose tokenizer it carries when one is cached (TOKENIZER_DONORS); None: none.
    tokenizer_family: str | None = "qwen2.5"
    max_position_embeddings: int = 32768

    def config(self):
        """The transformers config (Qwen2Config) of this architecture."""
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab_rows,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            tie_word_embeddings=self.tied_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=self.num_layers,
            architectures=["Qwen2ForCausalLM"],
        )


# Qwen2.5 (../shared/MODELS.md): all rope_theta 1e6, rms_norm_eps 1e-6, 32768
# positions, no sliding window, one tokenizer of 151665 tokens.
SYNTH_MODELS: Mapping[str, SynthSpec] = MappingProxyType({spec.name: spec for spec in (
    SynthSpec("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, tied_embeddings=True),
    SynthSpec("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 151936, tied_embeddings=True),
    SynthSpec("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, tied_embeddings=False),
    SynthSpec("qwen2.5-14b", 5120, 13824, 48, 40, 8, 152064, tied_embeddings=False),
    SynthSpec("qwen2.5-32b", 5120, 27648, 64, 40, 8, 152064, tied_embeddings=False),
    # For tests: builds in milliseconds; no tokenizer.
    SynthSpec("tiny", 64, 128, 2, 4, 2, 512, tied_embeddings=False, tokenizer_family=None,
              max_position_embeddings=4096),
)})


def is_synth_name(model: str) -> bool:
    """Whether a --model value names a synthetic model ("synth:NAME")."""
    return model.startswith(PREFIX)


def synth_names() -> list[str]:
    """The known names, smallest Qwen2.5 first."""
    return list(SYNTH_MODELS)


def get_synth(name: str) -> SynthSpec:
    """The spec of NAME or "synth:NAME"; ModelNotFoundError names the known ones."""
    try:
        return SYNTH_MODELS[name.removeprefix(PREFIX)]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown synthetic model {name.removeprefix(PREFIX)!r}; known: {', '.join(synth_names())}"
        ) from None


def parameter_count(name: str) -> int:
    """Parameters of the architecture (tied embeddings counted once), from a
    build on the meta device: no memory, no time."""
    from specdec.models.skeleton import meta_model

    return sum(p.numel() for p in meta_model(get_synth(name).config()).parameters())


def build_model(name: str, device: str = "cpu", dtype=None, attn_implementation: str = "sdpa"):
    """The model with random weights, built directly on `device` in `dtype`
    (no float32 copy on the CPU first), in eval mode."""
    import torch

    dtype = dtype or torch.float32
    spec = get_synth(name)
    target = torch.device(device)
    cuda = [target.index if target.index is not None else torch.cuda.current_device()] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # seed the build without touching the caller's generator
        torch.manual_seed(SEED)
        with target:
            model = _from_config(spec, dtype, attn_implementation)
    return model.eval()


def _from_config(spec: SynthSpec, dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(spec.config(), dtype=dtype, attn_implementation=attn_implementation)


def tokenizer_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """A cached model directory holding the tokenizer NAME carries, or None."""
    family = get_synth(name).tokenizer_family
    for donor in TOKENIZER_DONORS.get(family, ()) if family else ():
        directory = model_dir(donor, cache_dir)
        if read_manifest(directory) is not None and (directory / "tokenizer.json").is_file():
            return directory
    return None


def id_space(name: str):
    """The token ids NAME's family gives, for when it has no tokenizer
    (an engine.vocab.IdSpace), or None for a model of no family."""
    family = get_synth(name).tokenizer_family
    if family is None:
        return None
    from specdec.engine.vocab import IdSpace

    return IdSpace(family, FAMILY_TOKENS[family])


def load_tokenizer(name: str, cache_dir: str | os.PathLike | None = None):
    """The tokenizer NAME carries (see the module docstring), or None."""
    directory = tokenizer_dir(name, cache_dir)
    family = get_synth(name).tokenizer_family
    if directory is None:
        if family:
            log.warning("%s: no cached %s tokenizer, so none (`specd models fetch %s` gets one)",
                        name, family, TOKENIZER_DONORS[family][0])
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


@dataclass(frozen=True)
class SynthMarker:
    """What `save` writes beside the weights, so nobody mistakes them for trained ones."""

    synthetic: str
    seed: int
    dtype: str
    parameters: int
    tokenizer_from: str | None
    note: str = "random weights: real step costs, meaningless outputs"


def save(name: str, out: str | os.PathLike, dtype: str = "bfloat16", device: str = "cpu",
         cache_dir: str | os.PathLike | None = None) -> Path:
    """Build NAME and save_pretrained it (and its tokenizer, when cached) into
    `out`, which must not exist or be empty. Returns `out`."""
    import torch

    spec = get_synth(name)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    model = build_model(spec.name, device, getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    source = tokenizer_dir(spec.name, cache_dir)
    if source is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(source)).save_pretrained(out)
    marker = SynthMarker(spec.name, SEED, dtype, sum(p.numel() for p in model.parameters()),
                         str(source) if source else None)
    (out / MARKER_NAME).write_text(json.dumps(asdict(marker), indent=2) + "\n")
    return out
