"""Services as child processes: wait until one reports SERVING, stop them all.

Shared by `specd up` (`specdec.cli.up_cmd`) and `specd bench`
(`specdec.bench.services`), which both start the roles as child processes.
"""
from __future__ import annotations

import signal
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_serving(port: int, procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until the server on `port` reports SERVING; fail early if any of
    `procs` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a service exited during start-up (see its log above)")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"the service on port {port} was not SERVING after {timeout_s:.0f} s")


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM every process (they drain), then SIGKILL what is left after grace_s."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
