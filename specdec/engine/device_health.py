"""Whether the device a model runs on still computes.

Some CUDA errors poison the process's CUDA context: after an illegal memory
access, a device-side assert or an uncorrectable ECC error every later kernel
launch and copy fails with the same error. A service in that state answered
every call with an error while its health checks, which touch no device,
said SERVING, so nothing took it out of rotation or restarted it. The model
services probe their device every few seconds (`SessionServicer`'s device
watch, specdec/rpc/model_service.py) with `probe`: a tiny kernel and a copy
back. One that fails is reported NOT_SERVING, liveness included, and the
process exits non-zero, to be restarted by `specd up` or its pod's
restartPolicy; the orchestrator moves its requests to other replicas.

A probe, not the error's message, decides: an error that left the context
usable (an out-of-memory, a bad argument) is not a reason to restart.
"""
from __future__ import annotations

PROBE_INTERVAL_S = 2.0  # how often a model service probes its GPU


def watched(device) -> bool:
    """Whether `device` (a torch.device, or None) is one whose failure a
    probe can see and a restart can cure: a CUDA device. A CPU that fails
    takes the process with it."""
    return device is not None and getattr(device, "type", None) == "cuda"


def probe(device) -> str | None:
    """None while `device` computes: a one-element kernel, then a copy of
    its result back to the host (which waits for it). Else why not: the
    error the device gives now. Run on the engine thread, between jobs."""
    import torch

    try:
        value = torch.ones(1, device=device).add_(1).cpu().item()
    except Exception as exc:  # noqa: BLE001 - whatever the device answers, it is the answer
        return f"{type(exc).__name__}: {exc}".strip()
    if value != 2.0:
        return f"a probe computed 1 + 1 = {value}"
    return None
