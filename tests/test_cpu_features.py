"""specdec/engine/cpu_features.py: the CPU's flags, read once, matched as
whole words (avx512_vnni is not avx_vnni)."""
from __future__ import annotations

import pathlib

from specdec.engine import cpu_features


def _with_cpuinfo(monkeypatch, text: str | None):
    def read_text(self, *args, **kwargs):
        if str(self) != "/proc/cpuinfo":
            raise AssertionError(self)
        if text is None:
            raise OSError("no /proc here")
        return text

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    cpu_features.cpu_flags.cache_clear()


def test_flags_are_whole_words_of_the_first_cpus_flags_line(monkeypatch):
    _with_cpuinfo(monkeypatch, "processor\t: 0\nmodel name\t: avx_vnni in a name\n"
                               "flags\t\t: fpu sse2 avx2 avx512_vnni amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    try:
        assert cpu_features.cpu_flags() == {"fpu", "sse2", "avx2", "avx512_vnni", "amx_bf16"}
        assert cpu_features.has_any("avx_vnni", "avx512_vnni")
        assert not cpu_features.has_any("avx_vnni")  # a word of the model name, not a flag
        assert not cpu_features.has_any("avx512")  # a prefix of a flag, not a flag
    finally:
        cpu_features.cpu_flags.cache_clear()


def test_without_proc_nothing_is_known(monkeypatch):
    _with_cpuinfo(monkeypatch, None)
    try:
        assert cpu_features.cpu_flags() == frozenset()
        assert not cpu_features.has_any("avx2")
    finally:
        cpu_features.cpu_flags.cache_clear()
