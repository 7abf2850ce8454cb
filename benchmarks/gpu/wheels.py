"""The wheels a lent GPU machine needs to run specdec, as `name==version` lines.

    python benchmarks/gpu/wheels.py            # what benchmarks/gpu/prepare.sh downloads

The GPU machines this project is lent (docs/benchmarks.md, "The GPU engine")
have torch, transformers, triton, numpy and most scientific packages in their
image, reach no package registry, and run our code under their own Python.
What specdec needs beyond that image travels as wheels: the closure of this
project's runtime requirements (and pytest-timeout, for the GPU tests), walked
through the packages installed here, minus what the image already has. The
versions are the ones installed here, so the machine runs what the tests here
ran. A few packages the image has are carried anyway, because our generated
code or its newer dependencies check their versions at import time: grpcio
(the generated `_pb2_grpc` stubs refuse an older one), protobuf (the `_pb2`
modules refuse an older runtime than the one that generated them) and
typing_extensions (pydantic's floor).

The image's package list is the one the device tool's KINDS.md recorded
(2026-11-17); a name missing from it here only costs a wheel that would not
have been needed.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys

# The image's packages (the device library's KINDS.md, "Python packages already there"),
# as normalized names.
IMAGE_HAS = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas
pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# Carried although the image has them: their versions are checked at import time (above).
CARRY_ANYWAY = {"grpcio", "protobuf", "typing-extensions"}
ROOTS = ("specdec", "pytest-timeout")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: md.Distribution) -> list[str]:
    """The names `dist` requires unconditionally on this platform (no extras)."""
    names = []
    for line in dist.requires or []:
        requirement, _, marker = line.partition(";")
        if "extra" in marker:
            continue
        if marker.strip() and not _marker_holds(marker):
            continue
        names.append(normalize(re.split(r"[\s<>=!~\[(]", requirement.strip(), maxsplit=1)[0]))
    return names


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # no packaging here: keep the requirement
        return True
    return Marker(marker.strip()).evaluate({"python_version": "3.12"})


def closure(roots=ROOTS) -> dict[str, str]:
    """Every installed distribution the roots need, name -> version."""
    found: dict[str, str] = {}
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            sys.exit(f"{name} is required but not installed here: install the project first (pip install -e '.[test]')")
        found[name] = dist.version
        todo.extend(requirements(dist))
    return found


def carried(found: dict[str, str]) -> list[str]:
    return sorted(f"{name}=={version}" for name, version in found.items()
                  if name != "specdec" and (name not in IMAGE_HAS or name in CARRY_ANYWAY))


if __name__ == "__main__":
    print("\n".join(carried(closure())))
