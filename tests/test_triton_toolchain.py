"""engine/model_facts.py: Triton's kernels run only where Triton can build its
launchers (a C compiler, Python's headers). Where it cannot, `auto` falls back
to SDPA with a warning that says what to install, instead of a CUDA engine
that fails at its first step; an explicit `--attention triton` is refused
with the same reason."""
from __future__ import annotations

import logging

import pytest
import torch

from specdec.engine import model_facts
from specdec.engine.model_facts import choose_kernel, triton_missing

pytest.importorskip("triton")
CUDA = torch.device("cuda")  # a device object needs no GPU: only the choice is tested


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(model_facts.shutil, "which", lambda name: None)


def test_without_a_c_compiler_triton_is_missing_and_auto_falls_back_to_sdpa(no_compiler, caplog):
    assert "no C compiler" in triton_missing() and "install gcc, or set CC" in triton_missing()
    with caplog.at_level(logging.WARNING, logger="specdec.engine.model_facts"):
        assert choose_kernel("auto", CUDA) == "sdpa"
    assert "without CUDA graphs or fused Triton layers" in caplog.text and "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="--attention triton: no C compiler"):
        choose_kernel("triton", CUDA)


def test_cc_names_the_compiler_as_triton_reads_it(no_compiler, monkeypatch):
    monkeypatch.setenv("CC", "/opt/cc/bin/cc")
    assert triton_missing() is None
    assert choose_kernel("auto", CUDA) == "triton"


def test_without_pythons_headers_triton_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "cc")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(model_facts.sysconfig, "get_paths", lambda scheme=None: {"include": str(tmp_path)})
    assert f"no Python.h in {tmp_path}" in triton_missing()


def test_the_interpreter_builds_nothing_and_a_cpu_never_asks(no_compiler, monkeypatch):
    assert choose_kernel("auto", torch.device("cpu")) == "sdpa"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_missing() is None


def test_the_fallback_to_sdpa_warns_once_and_an_explicit_sdpa_still_hears_about_graphs(no_compiler, caplog):
    with caplog.at_level(logging.INFO, logger="specdec.engine.model_facts"):
        kernel = choose_kernel("auto", CUDA)
        assert model_facts.wants_graphs("auto", CUDA, kernel, "auto") is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "without CUDA graphs" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specdec.engine.model_facts"):
        assert model_facts.wants_graphs("auto", CUDA, "sdpa", "sdpa") is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "CUDA graphs off" in caplog.text
