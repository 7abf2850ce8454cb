"""What the benchmark ran on: CPU, cores, memory, GPUs, library versions."""
from __future__ import annotations

import os
import platform
import sys


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError):
        pass
    return None


def describe_machine() -> dict:
    """A JSON-ready description of this machine and the libraries in use."""
    import torch
    import transformers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": _memory_gib(),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }


def machine_line(machine: dict) -> str:
    """One Markdown-ready line: CPU, cores, memory, GPUs, versions."""
    gpu = ", ".join(machine.get("gpus") or []) or "no GPU"
    return (f"{machine.get('cpu')}, {machine.get('usable_cores')} usable cores of {machine.get('cores')}, "
            f"{machine.get('memory_gib')} GiB RAM, {gpu}; Python {machine.get('python')}, "
            f"torch {machine.get('torch')}, transformers {machine.get('transformers')}")
