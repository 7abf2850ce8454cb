"""A model's transformers config, and the model built from it on torch's
meta device: its shapes and parameter counts without memory, weights or time
(the bench's memory check, the synthetic models' sizes)."""
from __future__ import annotations

from pathlib import Path

import torch


def model_config(model: str):
    """The transformers config of a synth:NAME model or a model directory
    (None: none here, e.g. a GGUF file or a hub id)."""
    from transformers import AutoConfig

    from specdec.models.synth import get_synth, is_synth_name

    if not is_synth_name(model) and not Path(model).is_dir():  # a GGUF file would be read whole, to fail as JSON
        return None
    try:
        return get_synth(model).config() if is_synth_name(model) else AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def meta_model(config, **kwargs):
    """The causal LM of `config` on the meta device (`kwargs` go to
    `from_config`); transformers' ValueError, KeyError or TypeError where it
    cannot build one."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)
