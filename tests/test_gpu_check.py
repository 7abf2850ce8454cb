"""The prepared GPU run (benchmarks/gpu/): the wheels it carries to a GPU
image, and that its scripts parse. The run itself needs the device tool."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"


def _wheels():
    spec = importlib.util.spec_from_file_location("gpu_wheels", GPU / "wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheels_cover_what_the_image_lacks_and_pin_what_is_checked_at_import():
    wheels = _wheels()
    carried = dict(line.split("==") for line in wheels.carried(wheels.closure()))
    # What the image lacks and specdec imports.
    for name in ("grpcio-health-checking", "grpcio-reflection", "opentelemetry-sdk", "opentelemetry-api",
                 "fastapi", "uvicorn", "starlette", "pydantic", "gguf", "platformdirs"):
        assert name in carried, name
    # Checked at import time (generated stubs, pydantic's floor), so carried at our versions.
    for name in ("grpcio", "protobuf", "typing-extensions"):
        assert name in carried, name
    # The image's heavy packages stay as they are: the GPU run tests transformers 5.17 there.
    for name in ("torch", "transformers", "numpy", "triton", "tokenizers", "safetensors", "matplotlib"):
        assert name not in carried, name
    assert "specdec" not in carried


def test_requirements_skip_extras_and_other_platforms():
    wheels = _wheels()

    class Dist:
        requires = ["grpcio>=1.85", "pytest>=8; extra == 'test'", "uvloop>=0.19; sys_platform != 'win32'",
                    "tomli>=1; python_version < '3.11'", "Typing_Extensions[extra]>=4"]

    assert wheels.requirements(Dist()) == ["grpcio", "uvloop", "typing-extensions"]


def test_the_scripts_parse():
    for script in ("prepare.sh", "check.sh"):
        subprocess.run(["bash", "-n", str(GPU / script)], check=True, timeout=30)
