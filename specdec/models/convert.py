"""Step 3 of `fetch` (fetch.py): a verified GGUF converted once into a plain
safetensors directory in the cache.

De-quantizing a GGUF with transformers takes tens of seconds on every load, so
the conversion runs once: load it de-quantized, save model and tokenizer into a
staging directory beside the final one, write the manifest last and rename the
directory into place, so an interrupted conversion never looks like a cached
model.
"""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from specdec.models.cache import Manifest, write_manifest
from specdec.models.catalog import ModelSpec
from specdec.models.gguf_wheels import FetchError, bars_enabled

__all__ = ["convert_gguf", "convert_into_cache"]


@contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own loading bars for the duration, then restore the setting.

    transformers' legacy GGUF reader ("Converting and de-quantizing GGUF
    tensors") uses tqdm directly and ignores this switch; that bar still shows.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def convert_gguf(
    gguf: Path, dest: Path, dtype: str = "float32", require_chat_template: bool = True, progress: bool = True
) -> None:
    """Load a GGUF de-quantized and write it into `dest` as a plain transformers directory.

    `GgufConfig(dequantize=True)` is transformers' public switch for unpacking
    every weight into a dense tensor at load time; with it transformers drops
    the quantization flag itself, so the result is an ordinary model that
    `save_pretrained` accepts (a GGUF loaded without it is flagged as quantized
    and refuses to save). float32 keeps the de-quantized values exactly.
    save_pretrained stores tied embeddings once and config.json keeps
    `tie_word_embeddings`, so the tie is restored on reload.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with _transformers_progress(bars_enabled(progress)):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=str(gguf), dtype=torch_dtype,
            quantization_config=GgufConfig(dequantize=True),
        )  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        raise FetchError(f"{gguf.name}: transformers kept the weights quantized; cannot store a plain copy")
    if require_chat_template and not tokenizer.chat_template:
        raise FetchError(f"{gguf.name}: the tokenizer read from the GGUF has no chat template")
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _match_permissions(directory: Path) -> None:
    """Give every file the mode config.json got from the umask.

    The safetensors writer creates its file owner-only (0600) while the other
    files follow the umask; without this a cache filled by one user (say, an
    init container) would be unreadable to the service that loads it.
    """
    mode = (directory / "config.json").stat().st_mode & 0o777
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(mode)


def _library_versions() -> tuple[str, str]:
    """(transformers, torch) versions, recorded in the manifest to explain a later difference."""
    import torch
    import transformers

    return transformers.__version__, torch.__version__


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename the finished staging directory to `final`, replacing a stale one.
    An old copy left by a run that died between the two renames (a whole
    model's size) is removed too."""
    stale = final.with_name(f".{final.name}.stale")
    shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        final.rename(stale)
        staging.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        staging.rename(final)


def convert_into_cache(spec: ModelSpec, gguf: Path, final: Path, dtype: str, progress: bool) -> None:
    """Convert into a staging directory beside `final`, write the manifest last, rename it in.

    The staging directory is hidden and has no manifest until the very end, so
    an interrupted conversion never looks like a cached model; it is cleared at
    the start of the next attempt.
    """
    staging = final.with_name(f".{final.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        convert_gguf(gguf, staging, dtype=dtype, require_chat_template=spec.has_chat_template, progress=progress)
        _match_permissions(staging)
        transformers_version, torch_version = _library_versions()
        write_manifest(
            staging,
            Manifest(
                name=spec.name,
                source_sha256=spec.gguf_sha256,
                source_size=spec.gguf_size,
                dtype=dtype,
                converted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                transformers_version=transformers_version,
                torch_version=torch_version,
            ),
        )
        _move_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
