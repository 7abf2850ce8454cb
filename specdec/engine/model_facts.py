"""What the engine reads off a model and its device before it serves: the
context it may hold, the KV geometry, the end-of-sequence ids, the attention
kernel and whether to capture CUDA graphs (specdec/engine/engine.py)."""
from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
import sysconfig

import torch
from transformers import DynamicCache

from specdec.engine.kv_store import KVShape

log = logging.getLogger(__name__)


def context_limit(config, requested: int) -> int:
    """max_context, capped by the model's positions and attention window."""
    limit = requested
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos:
        limit = min(limit, int(max_pos))
    layer_types = getattr(config, "layer_types", None) or []
    windowed = any(t != "full_attention" for t in layer_types)
    window = getattr(config, "sliding_window", None)
    if (windowed or getattr(config, "use_sliding_window", False)) and window:
        # The store's attention is plain causal attention.
        limit = min(limit, int(window))
    return limit


def cache_kwarg(model) -> str:
    """The keyword under which `model`'s forward takes the KV cache:
    `past_key_values` up to transformers 5.2x, then `cache` (the old name is
    deprecated there and goes in 5.40, after which it would be swallowed by
    the forward's **kwargs and the cache silently not used)."""
    return _cache_kwarg(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_type: type) -> str:
    parameters = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def output_cache(output):
    """The cache a forward returned, under either name (`cache_kwarg`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def probe_kv_shape(model, device: torch.device) -> KVShape:
    """Read the KV geometry off a one-token forward (any architecture)."""
    probe = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True,
              **{cache_kwarg(model): probe})
    layers = probe.layers
    keys, values = layers[0].keys, layers[0].values
    return KVShape(
        num_layers=len(layers),
        kv_heads=keys.shape[1],
        head_dim=keys.shape[3],
        value_dim=values.shape[3],
        dtype=keys.dtype,
        device=keys.device,
    )


def eos_ids(model, vocab_size: int | None = None) -> tuple[int, ...]:
    """The model's end-of-sequence ids (generation_config and config), sorted;
    with `vocab_size`, only those below it."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return tuple(sorted(i for i in ids if vocab_size is None or 0 <= i < vocab_size))


def choose_kernel(requested: str, device: torch.device) -> str:
    """The attention kernel: `auto` is the fused Triton kernel on CUDA (where
    Triton can run: `triton_missing`), SDPA otherwise."""
    if requested == "auto":
        if device.type != "cuda":
            return "sdpa"
        missing = triton_missing()
        if missing:
            log.warning("attention on SDPA, without CUDA graphs or fused Triton layers (slower): %s", missing)
            return "sdpa"
        return "triton"
    if requested == "triton" and device.type != "cuda" and not _triton_interpreted():
        raise ValueError("--attention triton needs a CUDA device")
    if requested == "triton" and (missing := triton_missing()):
        raise ValueError(f"--attention triton: {missing}")
    return requested


def wants_graphs(setting: str, device: torch.device, kernel: str, requested_kernel: str = "auto") -> bool:
    """Whether to run fixed-shape steps captured as CUDA graphs (`--cuda-graphs`).
    `requested_kernel` is `--attention` as given: where `auto` fell back to
    SDPA, `choose_kernel` has already warned that graphs are off, and why."""
    if device.type != "cuda" or setting == "off":
        return False
    if kernel != "triton":
        if setting == "on":
            raise ValueError("--cuda-graphs on needs the fused attention kernel (--attention triton)")
        (log.info if requested_kernel == "auto" else log.warning)(
            "CUDA graphs off: they capture the fused Triton attention kernel, and attention runs on SDPA")
        return False
    return True


def wants_fused(setting: str, model) -> bool:
    """Whether to run the model as fused layers (`--fused-layers`; fused_decoder.py):
    `auto` wherever the model allows, on any device (on a CPU its reference ops
    give transformers' logits bit for bit, 2-17% sooner: docs/benchmarks.md)."""
    from specdec.engine.fused_decoder import why_not

    if setting == "off":
        return False
    reason = why_not(model)
    if setting == "on" and reason is not None:
        raise ValueError(f"--fused-layers on cannot run this model: {reason}")
    if reason is not None:  # auto
        log.info("fused layers off: %s", reason)
        return False
    return True


def triton_missing() -> str | None:
    """Why Triton's kernels cannot run here, or None. Besides the package,
    Triton builds a small C launcher for each kernel at its first launch, with
    the C compiler it finds as triton.runtime.build does ($CC, else gcc, else
    clang) and Python's headers: a slim container image has neither, and the
    first step would fail there (the Dockerfile installs a compiler into the
    CUDA image). Under TRITON_INTERPRET=1 nothing is built."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    if _triton_interpreted():
        return None
    cc, include = triton_toolchain()
    if not cc:
        return "no C compiler (Triton builds a launcher at a kernel's first launch): install gcc, or set CC"
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"no Python.h in {include} (Triton's launcher needs Python's headers): install the Python dev package"
    return None


def triton_toolchain() -> tuple[str | None, str]:
    """(the C compiler Triton would use, or None; the folder it takes Python.h
    from), found as triton.runtime.build finds them."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    scheme = sysconfig.get_default_scheme()
    return cc, sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


def _triton_interpreted() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on the CPU (slowly): how the
    fused kernel is tested without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"
