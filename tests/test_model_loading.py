"""engine/loading.py: how a checkpoint becomes a model. On a GPU the weights go
straight to the device (`device_map`), so the host never holds the whole
model; if transformers cannot load that way, the model loads on the CPU and
moves, as it always did. (The GPU path itself: tests/test_gpu_engine.py.)"""
from __future__ import annotations

import pytest
import torch

from specdec.engine import loading
from specdec.engine.config import EngineConfig
from specdec.errors import NotFound


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
