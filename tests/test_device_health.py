"""A model service whose GPU stops computing (a CUDA error that poisons the
context: an illegal address, a device-side assert) reports NOT_SERVING,
liveness included, and its process exits non-zero, instead of answering
every call with an error while its health said SERVING
(specdec/engine/device_health.py; the device watch in
specdec/rpc/model_service.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.cli import serve_cmd
from specdec.engine import device_health
from specdec.errors import SpecdecError
from tests.conftest import tiny_engine
from tests.harness import running_target, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING


def test_a_cpu_computes_and_is_not_watched():
    assert device_health.probe(torch.device("cpu")) is None
    assert not device_health.watched(torch.device("cpu")) and not device_health.watched(None)
    assert device_health.watched(torch.device("cuda", 0))


def _status(port: int, service: str = "") -> object:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError as exc:
            return exc.code()


def test_a_service_whose_device_fails_stops_serving_and_says_why(monkeypatch):
    """The probe is made to fail after a few good answers, as a device that
    hits a sticky error while serving: the service drains itself (every
    status NOT_SERVING, then the port closed) and records why, which
    `specd serve` turns into a non-zero exit."""
    answers = iter([None, None])
    probes = []

    def probe(device):
        probes.append(device)
        return next(answers, "AcceleratorError: CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(device_health, "PROBE_INTERVAL_S", 0.05)
    monkeypatch.setattr(device_health, "watched", lambda device: True)  # the tiny CPU engine stands in for a GPU's
    monkeypatch.setattr(device_health, "probe", probe)
    with running_target(tiny_engine(seed=0)) as (service, _, _):
        running = service.running
        wait_until(lambda: running.failure is not None, 20)
        assert len(probes) >= 3
        assert "illegal memory access" in running.failure and "failed" in running.failure
        wait_until(lambda: _status(service.port) != SERVING, 20)  # liveness's "" too: restart it
        with pytest.raises(SpecdecError, match="stopped: the model's device .* failed: .*illegal memory access"):
            serve_cmd._raise_if_failed(running)


def test_a_service_whose_device_computes_keeps_serving(monkeypatch):
    probes = []
    monkeypatch.setattr(device_health, "PROBE_INTERVAL_S", 0.02)
    monkeypatch.setattr(device_health, "watched", lambda device: True)
    monkeypatch.setattr(device_health, "probe", lambda device: probes.append(device))
    with running_target(tiny_engine(seed=0)) as (service, _, _):
        wait_until(lambda: len(probes) >= 5, 20)
        assert service.running.failure is None and _status(service.port) == SERVING
        serve_cmd._raise_if_failed(service.running)  # no failure: nothing raised


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_probe_tells_a_poisoned_context_from_an_error_that_left_it_usable():
    """In a process of its own (the assert poisons that process's context):
    an out-of-range index's device-side assert fails every probe after it;
    an out-of-memory does not."""
    script = textwrap.dedent("""
        import torch
        from specdec.engine import device_health
        device = torch.device("cuda")
        assert device_health.probe(device) is None
        try:
            torch.empty(1 << 50, device=device)
        except torch.cuda.OutOfMemoryError:
            pass
        assert device_health.probe(device) is None, "an out-of-memory leaves the device usable"
        x = torch.zeros(4, device=device)
        try:
            x[torch.tensor([10], device=device)] = 1.0
            torch.cuda.synchronize()
        except Exception:
            pass
        why = device_health.probe(device)
        assert why is not None and "assert" in why.lower(), why
        print("ok", why)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr
