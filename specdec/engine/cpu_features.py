"""What this CPU computes natively, from the kernel's /proc/cpuinfo (Linux;
elsewhere nothing is known, and every question answers False)."""
from __future__ import annotations

import functools
import pathlib


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags (`avx512_bf16`, `amx_int8`, ...)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_any(*flags: str) -> bool:
    return not cpu_flags().isdisjoint(flags)
