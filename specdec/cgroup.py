"""What this process's cgroup (a container's limits) leaves it of the host's memory.

Inside a container /proc/meminfo describes the whole node: a pod limited to
10 GiB on a 256 GiB node reads ~250 GiB available there, and a KV budget of
half of that is a promise the kernel's OOM killer breaks once enough session
slots are written. The cgroup says what the pod may still use: its limit
less its working set (its usage less the page cache it may reclaim, which is
what kubelet counts against the limit as well).
"""
from __future__ import annotations

import os

ROOT = "/sys/fs/cgroup"


def memory_headroom(root: str = ROOT) -> int | None:
    """Bytes the cgroup may still use before its memory limit (cgroup v2's
    memory.max, else v1's memory.limit_in_bytes); None without a limit."""
    for limit_file, usage_file, inactive_key in (("memory.max", "memory.current", "inactive_file"),
                                                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                                  "total_inactive_file")):
        limit = _read_int(os.path.join(root, limit_file))
        if limit is None:
            continue
        if limit >= 1 << 60:  # cgroup v1 writes "no limit" as a huge number
            return None
        usage = _read_int(os.path.join(root, usage_file)) or 0
        stat = os.path.join(root, os.path.dirname(limit_file), "memory.stat")
        reclaimable = _stat_value(stat, inactive_key)
        return max(0, limit - max(0, usage - reclaimable))
    return None


def _read_int(path: str) -> int | None:
    """The file's integer; None when it is missing, unreadable, or "max"."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0
