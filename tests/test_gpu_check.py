"""The prepared GPU run (benchmarks/gpu/): the wheels it carries to a GPU
image, and that its scripts parse. The run itself needs the device tool."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"


def _script(name: str):
    """benchmarks/gpu/NAME.py as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheels():
    return _script("wheels")


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


def _switches():
    return _script("switches")


def test_the_switches_know_every_check_of_the_pre_flight():
    import re

    named = re.findall(r'^@check\("([^"]+)"\)', (GPU / "smoke.py").read_text(), flags=re.M)
    assert tuple(named) == _switches().CHECKS


def test_what_the_pre_flight_failed_stays_off_and_a_failed_reference_switches_nothing(tmp_path):
    """check.sh exports what benchmarks/gpu/switches.py prints for smoke.py's
    log: the reference engine failing is a check of its own now, not told
    apart from the default engine's failure by the words of its exception."""
    switches = _switches().switches
    ok = "OK   toolchain: triton 3.6 (0.1s)\n"
    assert switches(ok) == [] and switches("") == []
    kernel = ok + "FAIL triton kernel vs float64 reference: AssertionError: bf16 7/1x128: 4e-2 <-- over 3e-2\n"
    assert [a for a, _ in switches(kernel)] == ["SPECD_ATTENTION=sdpa", "SPECD_FUSED_LAYERS=off"]
    engine = "FAIL engine: graphs+fused vs transformers+sdpa eager: AssertionError: argmax equal 30/32\n"
    assert switches(engine) == [("SPECD_FUSED_LAYERS=off", "the default engine failed")]
    reference = ("FAIL engine: reference (transformers+sdpa eager): RuntimeError: CUDA error: an illegal memory access\n"
                 "OK   engine: graphs+fused vs transformers+sdpa eager: not compared: the reference engine failed\n")
    assert switches(reference) == []
    ahead = "FAIL draft: run ahead vs steps one at a time: AssertionError: float32: drafted differently at 3\n"
    assert [a for a, _ in switches(engine + ahead)] == ["SPECD_FUSED_LAYERS=off", "SPECD_RUN_AHEAD=off"]
    broken = "FAIL draft: run ahead vs steps one at a time: ImportError: cannot import name 'x'\n"
    assert switches(broken) == []  # the check broke: run ahead stays as it is
    graphs = "FAIL pick graphs: capture cost of a new shape: AssertionError: 8 rows None: replay != eager\n"
    assert switches(graphs) == [("SPECD_PICK_GRAPHS=off", "the draft's pick graphs failed the pre-flight")]
    assert switches(graphs.replace("AssertionError: 8 rows None: replay != eager", "ImportError: x")) == []
    log = tmp_path / "smoke.log"
    log.write_text(kernel + ahead.replace("drafted differently", "no step ran ahead"))
    printed = subprocess.run(["python3", str(GPU / "switches.py"), str(log)], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    assert printed == ("SPECD_ATTENTION=sdpa\tthe attention kernel failed\n"
                       "SPECD_FUSED_LAYERS=off\tthe attention kernel failed\n"
                       "SPECD_RUN_AHEAD=off\tthe draft's steps run ahead failed the pre-flight\n")
    missing = subprocess.run(["python3", str(GPU / "switches.py"), str(tmp_path / "none.log")], capture_output=True,
                             text=True, check=True, timeout=30).stdout
    assert missing == ""
