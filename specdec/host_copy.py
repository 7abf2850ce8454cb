"""Host values to a device without a host sync.

`torch.tensor(values, device="cuda")`, or `.to("cuda")` of a tensor in
pageable memory, waits for everything already queued on the stream (a step
just launched): a host sync per call. Through pinned memory the copy is
queued like any other work. The engine's steps and the draft's picks both
copy small host lists this way (a step's positions, a batch's row index,
the sampling uniforms).
"""
from __future__ import annotations

import torch


def host_staged(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values as a CPU tensor to copy to `device`: pinned for a CUDA
    device, so the copy can be asynchronous."""
    staged = torch.tensor(values, dtype=dtype)
    return staged.pin_memory() if device.type == "cuda" else staged


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values as a tensor on `device`, copied without waiting (see the module doc)."""
    return host_staged(values, device, dtype).to(device, non_blocking=True)
