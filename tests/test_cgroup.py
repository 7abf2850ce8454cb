"""specdec/cgroup.py: what a container's memory limit leaves, in either cgroup version."""
from __future__ import annotations

import pytest
import torch

from specdec import cgroup
from specdec.engine import loading

GIB = 1 << 30


@pytest.mark.parametrize("files, headroom", [
    # cgroup v2: limit 10 GiB, 7 GiB used of which 2 GiB is reclaimable page cache
    ({"memory.max": f"{10 * GIB}\n", "memory.current": f"{7 * GIB}\n",
      "memory.stat": f"anon {5 * GIB}\ninactive_file {2 * GIB}\n"}, 5 * GIB),
    ({"memory.max": "max\n", "memory.current": f"{GIB}\n"}, None),  # no limit
    # cgroup v1
    ({"memory/memory.limit_in_bytes": f"{4 * GIB}\n", "memory/memory.usage_in_bytes": f"{3 * GIB}\n",
      "memory/memory.stat": f"total_inactive_file {GIB}\n"}, 2 * GIB),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"}, None),
    ({}, None),  # no cgroup files at all
    ({"memory.max": f"{GIB}\n", "memory.current": f"{2 * GIB}\n"}, 0),  # over its limit: nothing left
])
def test_a_cgroups_memory_headroom_is_read_in_either_version(tmp_path, files, headroom):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup.memory_headroom(str(tmp_path)) == headroom


def test_free_cpu_memory_is_capped_by_the_containers_limit(monkeypatch):
    """A pod's KV budget (half of this, by default) must fit its limit, not the node's memory."""
    monkeypatch.setattr(loading, "_host_memory_available", lambda: 200 * GIB)
    monkeypatch.setattr(cgroup, "memory_headroom", lambda: 6 * GIB)
    assert loading.free_device_memory(torch.device("cpu")) == 6 * GIB
    monkeypatch.setattr(cgroup, "memory_headroom", lambda: None)
    assert loading.free_device_memory(torch.device("cpu")) == 200 * GIB
