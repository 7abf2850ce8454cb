"""Whether a bench's models fit the memory they will share, checked before
anything loads.

`specd bench` loads the target in its service and, for the HF baselines, again
in its own process (and the draft twice for HF assisted generation), all on
the devices the flags name. A pair too large for them fails minutes in: on a
CPU the kernel's OOM killer ends a service (or the bench) with no message of
ours, and on a GPU a load raises out of memory. So `bench_options` counts the
weights first, from the models' configs (on torch's meta device: no memory,
no weights read), and refuses a run whose weights alone exceed what the
device has free, naming what would load where.

Only the weights are counted: the KV store sizes itself to what is free after
them (`--max-kv-bytes` aside), and a process's own few hundred MB are left
out, so a run this lets through may still be tight; one it refuses cannot fit.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class Load:
    """One copy of a model's weights that a run holds on a device."""

    what: str  # e.g. "target (service)"
    device: str
    nbytes: int


def model_config(model: str):
    """The transformers config of a synth:NAME model or a model directory
    (None: none here, e.g. a GGUF file or a hub id)."""
    from transformers import AutoConfig

    from specdec.models.synth import get_synth, is_synth_name

    try:
        return get_synth(model).config() if is_synth_name(model) else AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def parameter_count(model: str) -> int | None:
    """Parameters of a synth:NAME model or a model directory, from its config
    alone (None: no config here)."""
    from transformers import AutoModelForCausalLM

    config = model_config(model)
    if config is None:
        return None
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError):
        return None
    return sum(p.numel() for p in skeleton.parameters())  # a tied head counts once


def loads(draft: str, target: str, draft_device: str, target_device: str, bytes_per_param: int,
          services: bool, hf_target: bool, hf_draft: bool) -> list[Load]:
    """The copies of the weights a run holds: the services' and the HF baselines' (in the bench's own
    process, on the same devices); a model whose size is unknown here is left out."""
    out = []
    for name, model, device, in_service, in_hf in (("target", target, target_device, services, hf_target),
                                                   ("draft", draft, draft_device, services, hf_draft)):
        params = parameter_count(model) if (in_service or in_hf) else None
        if params is None:
            continue
        for where, wanted in (("service", in_service), ("HF baselines", in_hf)):
            if wanted:
                out.append(Load(f"{name} ({where})", device, params * bytes_per_param))
    return out


def overcommitted(run: list[Load], free_bytes) -> str | None:
    """Why the run's weights cannot fit (None: they can); `free_bytes(device)` gives what is free."""
    by_device: dict[str, list[Load]] = defaultdict(list)
    for load in run:
        device = torch.device(load.device)
        by_device["cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"].append(load)
    for device, items in by_device.items():
        need = sum(item.nbytes for item in items)
        free = free_bytes(device)
        if need > free:
            parts = ", ".join(f"{item.what} {item.nbytes / GIB:.1f}" for item in items)
            return (f"the models' weights need {need / GIB:.1f} GiB on {device} ({parts}) and {free / GIB:.1f} GiB "
                    "is free there")
    return None
