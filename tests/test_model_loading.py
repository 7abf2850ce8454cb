"""engine/loading.py: how a checkpoint becomes a model. On a GPU the weights go
straight to the device (`device_map`), so the host never holds the whole
model; if transformers cannot load that way, the model loads on the CPU and
moves, as it always did, unless it ran out of device memory, which a CPU load
would only meet again later. (The GPU path itself: tests/test_gpu_engine.py.)"""
from __future__ import annotations

import pytest
import torch

from specdec.engine import loading
from specdec.engine.config import EngineConfig
from specdec.errors import NotFound, ResourceExhausted


class Recorder:
    """Stands in for AutoModelForCausalLM.from_pretrained: records each call's
    keyword arguments; raises `fail` when called with device_map."""

    def __init__(self, fail: Exception | None = None):
        self.calls: list[dict] = []
        self.fail = fail

    def __call__(self, where, **kwargs):
        self.calls.append(kwargs)
        if self.fail is not None and "device_map" in kwargs:
            raise self.fail
        return "model"


@pytest.fixture
def recorder(monkeypatch):
    def use(fail=None):
        rec = Recorder(fail)
        monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", rec)
        return rec
    return use


def test_on_a_gpu_the_weights_load_straight_onto_the_device(recorder):
    rec = recorder()
    assert loading._from_pretrained(EngineConfig(device="cuda:1"), "dir", torch.bfloat16, {}) == "model"
    assert [c.get("device_map") for c in rec.calls] == ["cuda:1"]


def test_on_the_cpu_and_for_a_gguf_they_load_on_the_cpu(recorder):
    rec = recorder()
    loading._from_pretrained(EngineConfig(device="cpu"), "dir", torch.float32, {})
    loading._from_pretrained(EngineConfig(device="cuda"), "dir", torch.bfloat16, {"gguf_file": "m.gguf"})
    assert [c.get("device_map") for c in rec.calls] == [None, None]
    assert rec.calls[1]["gguf_file"] == "m.gguf"


def test_a_device_load_that_fails_falls_back_to_the_cpu_and_says_so(recorder, caplog):
    rec = recorder(TypeError("device_map is not supported"))
    assert loading._from_pretrained(EngineConfig(model="m", device="cuda"), "dir", torch.bfloat16, {}) == "model"
    assert [c.get("device_map") for c in rec.calls] == ["cuda", None]
    assert "loading straight to cuda failed (TypeError: device_map is not supported)" in caplog.text


def test_a_missing_model_is_not_found_on_either_path(recorder):
    recorder(OSError("no such directory"))
    with pytest.raises(NotFound, match="cannot load model 'm'"):
        loading._from_pretrained(EngineConfig(model="m", device="cuda"), "dir", torch.bfloat16, {})


def test_running_out_of_device_memory_does_not_retry_through_the_host(recorder):
    # A CPU load would hold the whole model in host memory and then run out on the device again.
    rec = recorder(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        loading._from_pretrained(EngineConfig(model="m", device="cuda"), "dir", torch.bfloat16, {})
    assert [c.get("device_map") for c in rec.calls] == ["cuda"]


def test_a_model_too_big_for_its_device_is_one_clear_resource_error(monkeypatch):
    def too_big(cfg):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(loading, "_load", too_big)
    monkeypatch.setattr(loading, "free_device_memory", lambda device: 3 * 2**30)
    with pytest.raises(ResourceExhausted) as caught:
        loading.load_model(EngineConfig(model="big", device="cuda:0"))
    message = str(caught.value)
    assert "model 'big' does not fit in the memory of cuda:0 (3.0 GiB free now)" in message
    assert "Tried to allocate 2.00 GiB" in message and "more detail" not in message
    assert "--quantize int8" not in message  # CUDA's memory, and int8 runs on the CPU only
