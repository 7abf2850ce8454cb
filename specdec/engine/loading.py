"""Load a causal LM and its tokenizer from a catalog name, a directory, a GGUF
file or a hub id, on the configured device and dtype."""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specdec import cgroup
from specdec.engine.config import EngineConfig
from specdec.engine.cpu_features import has_any
from specdec.engine.vocab import IdSpace, known_vocab, ships_tokenizer
from specdec.errors import NotFound, ResourceExhausted
from specdec.models.cache import locate

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object | None  # a transformers tokenizer, or None for bare test models
    name: str
    id_space: IdSpace | None = None  # without a tokenizer: the family's ids (vocab.IdSpace)


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    return has_any("avx512_bf16", "amx_bf16")


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def apply_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)


def load_model(cfg: EngineConfig) -> LoadedModel:
    """Load `cfg.model` for inference; raises NotFound for an unknown model,
    ResourceExhausted for one that does not fit on its device."""
    cfg.validate()
    try:
        return _load(cfg)
    except torch.cuda.OutOfMemoryError as exc:
        free = free_device_memory(torch.device(cfg.device)) / 2**30
        raise ResourceExhausted(
            f"model {cfg.model!r} does not fit in the memory of {cfg.device} ({free:.1f} GiB free now): "
            f"{str(exc).splitlines()[0]} Give it a device with more memory, a smaller --dtype, "
            f"or a smaller model.") from None


def _load(cfg: EngineConfig) -> LoadedModel:
    from specdec.models import synth

    if synth.is_synth_name(cfg.model):  # random weights of a real architecture, built in place
        return _load_synth(cfg)
    apply_threads(cfg.threads)
    where, gguf_file = locate(cfg.model)
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = _from_pretrained(cfg, where, dtype, kwargs)
    model.to(cfg.device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer for %s: %s", cfg.model, exc)
        tokenizer = None
    if not ships_tokenizer(where, gguf_file):
        tokenizer = None  # one transformers made up (Qwen2: one token), not the model's
    return LoadedModel(model=model, tokenizer=tokenizer, name=cfg.model)


def _load_synth(cfg: EngineConfig) -> LoadedModel:
    """A "synth:NAME" model built in memory on cfg.device in cfg.dtype;
    NotFound for an unknown name."""
    from specdec.models import synth
    from specdec.models.catalog import ModelNotFoundError

    try:
        synth.get_synth(cfg.model)
    except ModelNotFoundError as exc:
        raise NotFound(str(exc)) from None
    apply_threads(cfg.threads)
    model = synth.build_model(cfg.model, cfg.device, resolve_dtype(cfg.dtype, cfg.device))
    log.info("%s: random weights, %.0f M parameters, on %s", cfg.model,
             sum(p.numel() for p in model.parameters()) / 1e6, cfg.device)
    tokenizer = synth.load_tokenizer(cfg.model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=cfg.model,
                       id_space=None if tokenizer is not None else synth.id_space(cfg.model))


def _from_pretrained(cfg: EngineConfig, where: str, dtype: torch.dtype, kwargs: dict):
    """The checkpoint as a model. On a GPU its weights go straight to the
    device, a tensor at a time (`device_map`): loading on the CPU first would
    hold the whole model in host memory, 15 GB for a 7B in bf16, over a GPU
    pod's memory limit (deploy/overlays/gpu). A GGUF is dequantized on the CPU
    by transformers either way, so it loads there and then moves."""
    on_gpu = torch.device(cfg.device).type == "cuda" and "gguf_file" not in kwargs
    kwargs = dict(kwargs, dtype=dtype, attn_implementation="sdpa")
    try:
        if on_gpu:
            try:
                return AutoModelForCausalLM.from_pretrained(where, device_map=cfg.device, **kwargs)
            except torch.cuda.OutOfMemoryError:
                raise  # loading on the CPU first would only run out again, later
            except (ImportError, TypeError, ValueError, RuntimeError) as exc:  # not a missing model: load as before
                log.warning("%s: loading straight to %s failed (%s: %s); loading on the CPU, then moving",
                            cfg.model, cfg.device, type(exc).__name__, exc)
        return AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except OSError as exc:
        raise NotFound(f"cannot load model {cfg.model!r}: {exc}") from exc


def tokenizer_fingerprint(tokenizer, vocab_size: int, id_space: IdSpace | None = None) -> str:
    """sha256 of the token-to-id map, so two services can check they agree
    (GGUF placeholder tokens left out: see engine/vocab.py); without a
    tokenizer, the family's ids or else the row count."""
    if tokenizer is None:
        return id_space.fingerprint() if id_space else f"untokenized-vocab-{vocab_size}"
    items = sorted(known_vocab(tokenizer).items(), key=lambda kv: kv[1])
    digest = hashlib.sha256()
    for token, idx in items:
        digest.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def free_device_memory(device: torch.device) -> int:
    """Bytes free on the device now (CPU: the kernel's MemAvailable, which
    counts reclaimable page cache: right after reading weights from disk,
    MemFree alone can be a small fraction of what a process may use; in a
    container, no more than its memory limit leaves: specdec/cgroup.py)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = _host_memory_available()
    headroom = cgroup.memory_headroom()
    return available if headroom is None else min(available, headroom)


def _host_memory_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 8 << 30