"""A content fingerprint of a loaded model's weights (ModelInfo.weights_fingerprint).

Target replicas must be one model: a request moves between them when one
fails, and the orchestrator promises the target model's own output
distribution, exactly. Token ids (the tokenizer fingerprint) do not show a
fine-tune, a model rebuilt from other weights, or other config numerics;
this does, for the price of a few reads per tensor:

    - the config's numerics the weights do not show (`_config_facts`);
    - each weight's name, dtype and shape, in the model's own order;
    - each weight's values: whole for a small tensor (a norm, a bias), else
      `SAMPLES` values at fixed, spread-out positions. A fine-tune changes
      nearly every value of the tensors it trains, so a few of each tensor
      tell two checkpoints apart; nothing close to all of a 15 GB checkpoint
      is read (a 1.5B model: 0.8 MB over some 340 tensors).

It is taken from the weights as loaded, in memory, not from the files:
whatever the model was loaded from (a safetensors directory, a GGUF
dequantized by transformers, a hub id, a `synth:` model drawn on its
device, a model a test builds), it says what the engine will compute with.
Two replicas loading the same checkpoint at the same dtype agree (a cast is
exact and deterministic); the same weights at another dtype differ, as
their outputs do. A `synth:` model built on a GPU is another model than one
built on a CPU (their random streams differ), and its fingerprint says so.

Computed before the engine re-forms the weights (fused products, packed or
int8 linears): a fused q/k/v or gate/up product (engine/fused_linears.py)
counts as its parts' own weights, so an engine over a model another engine
already fused still gets the fingerprint the model had as loaded.
Not computed over the whole config.json either: a conversion by another
transformers version writes other keys, and one model must keep its
fingerprint across a software upgrade of the services.

Importing this module does not import torch.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Iterator

# Bumped whenever what is hashed changes: two services of different versions
# then disagree visibly ("w1:..." vs "w2:...") instead of by a false mismatch
# that looks like another model.
VERSION = "w1"
# Values read from each tensor larger than WHOLE; those up to WHOLE are read whole.
SAMPLES = 1024
WHOLE = 4096
# Sample i of a tensor of n values is value (i * _STRIDE) % n: a prime
# stride spreads the positions over the whole tensor, across rows and
# columns, without aliasing with its row length.
_STRIDE = 2654435761


def weights_fingerprint(model) -> str:
    """The fingerprint of `model`'s weights, "w1:<sha256 hex>" (module doc)."""
    import torch

    digest = hashlib.sha256(VERSION.encode())
    digest.update(json.dumps(_config_facts(getattr(model, "config", None)), sort_keys=True).encode())
    pieces = []
    positions: dict[tuple[int, object], torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in _weights(model):
            digest.update(f"{name}\t{str(tensor.dtype).removeprefix('torch.')}\t{list(tensor.shape)}\n".encode())
            pieces.append(_sample(tensor, positions))
        if pieces:
            device = pieces[0].device
            # One copy off the device for all of them (on a GPU, one sync).
            data = torch.cat([p.to(device) for p in pieces]).cpu()
            digest.update(data.numpy().tobytes())
    return f"{VERSION}:{digest.hexdigest()}"


def timed_fingerprint(model) -> tuple[str, float]:
    """(weights_fingerprint(model), seconds it took)."""
    start = time.perf_counter()
    fingerprint = weights_fingerprint(model)
    return fingerprint, time.perf_counter() - start


def _sample(tensor, positions: dict):
    """The bytes of `tensor`'s sampled values (all of a small one), a uint8 tensor on its device."""
    import torch

    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n > WHOLE:
        key = (n, flat.device)
        if key not in positions:
            positions[key] = ((torch.arange(SAMPLES, dtype=torch.int64) * _STRIDE) % n).to(flat.device)
        flat = flat[positions[key]]
    return flat.contiguous().view(torch.uint8)


def _weights(model) -> Iterator[tuple[str, object]]:
    """(name, tensor) of each weight as transformers loads the model, each
    shared tensor (tied embeddings) once: a fused product's parts
    (engine/fused_linears.py) as their own weights, a slice of the product's."""
    from torch import nn

    from specdec.engine.fused_linears import FusedPart

    seen: set[int] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, FusedPart) and type(module.shared[0].layer) is nn.Linear:
            product = module.shared[0].layer
            seen.update(id(p) for p in product.parameters(recurse=False))
            for name, param in product.named_parameters(recurse=False):
                yield _join(prefix, name), param[module.start:module.stop]
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield _join(prefix, name), param


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _config_facts(config) -> dict:
    """What the config decides that the weights do not show: the activation,
    the norm's epsilon, the rotary embedding, the attention heads. Read by
    meaning, not by key, so that the same model keeps its facts whatever
    transformers version wrote or reads its config (rope_theta moved into
    rope_parameters in transformers 5)."""
    if config is None:
        return {}

    def first(*names):
        for name in names:
            value = getattr(config, name, None)
            if value is not None:
                return value
        return None

    rope = first("rope_parameters", "rope_scaling")
    rope = dict(rope) if isinstance(rope, dict) else {}
    heads = first("num_attention_heads", "n_head")
    hidden = first("hidden_size", "n_embd")
    head_dim = first("head_dim") or (hidden // heads if hidden and heads else None)
    facts = {
        "model_type": first("model_type"),
        "activation": first("hidden_act", "activation_function"),
        "norm_eps": first("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"),
        "rope_theta": rope.get("rope_theta", first("rope_theta")),
        "rope_type": rope.get("rope_type", rope.get("type", "default")) if rope or first("rope_theta") else None,
        "rope_factor": rope.get("factor"),
        "partial_rotary_factor": rope.get("partial_rotary_factor", first("partial_rotary_factor")),
        "heads": heads,
        "kv_heads": first("num_key_value_heads") or heads,
        "head_dim": head_dim,
    }
    return {key: _plain(value) for key, value in facts.items()}


def _plain(value):
    """A JSON-ready value: numbers as floats (1000000 and 1e6 are one theta)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return str(value)
