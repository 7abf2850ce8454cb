"""Services as child processes: wait until one reports SERVING, keep them
running (`Supervisor`: restart with backoff), stop them all.

Shared by `specd up` (`specdec.cli.up_cmd`) and `specd bench`
(`specdec.bench.services`), which both start the roles as child processes.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_serving(port: int, procs: list[subprocess.Popen], timeout_s: float, credentials=None) -> None:
    """Wait until the server on `port` reports SERVING; fail early if any of
    `procs` exits meanwhile. `credentials` (grpc channel credentials): the
    port speaks TLS."""
    deadline = time.monotonic() + timeout_s
    address = f"127.0.0.1:{port}"
    with (grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)) as channel:
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


@dataclass(frozen=True)
class Backoff:
    """Restart delays: `initial_s`, doubled per consecutive exit up to
    `max_s`; a child that stayed up `stable_s` starts again from `initial_s`."""

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, failures: int) -> float:
        """The delay before restart number `failures` (1 = the first) of a run of exits."""
        return min(self.max_s, self.initial_s * 2 ** max(0, failures - 1))


@dataclass
class Child:
    """One supervised role: its command, and its process while it runs."""

    role: str
    cmd: list[str]
    env: dict | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive exits that came too soon after a start
    restart_at: float | None = None  # when a pending restart is due
    restarts: int = 0


class Supervisor:
    """Keeps child processes running, the way a process manager does: a child
    that exits is started again after a backoff, with a log line, and the
    others go on; `stop()` ends them all.

    Single-threaded: the owner calls `poll()` periodically (`specd up` every
    0.5 s). A child that cannot start at all (a bad flag) is restarted
    forever at the longest delay; its log lines say so.
    """

    def __init__(self, backoff: Backoff = Backoff(), log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.backoff = backoff
        self.children: dict[str, Child] = {}
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._clock = clock
        self._stopped = False

    def start(self, role: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        child = self.children.setdefault(role, Child(role, cmd, env))
        self._spawn(child)
        return child.proc

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [c.proc for c in self.children.values() if c.proc is not None]

    def poll(self) -> None:
        """Notice exits, schedule their restarts, and start those that are due."""
        if self._stopped:
            return
        now = self._clock()
        for child in self.children.values():
            if child.restart_at is None and child.proc is not None and child.proc.poll() is not None:
                self._exited(child, now)
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._log(f"specd up: restarting {child.role} (restart {child.restarts})")
                self._spawn(child)

    def stop(self, grace_s: float = 30.0) -> None:
        self._stopped = True
        for child in self.children.values():
            child.restart_at = None
        stop_processes(self.processes, grace_s)

    def _spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.cmd, env=child.env, start_new_session=True)
        child.started_at = self._clock()
        child.restart_at = None

    def _exited(self, child: Child, now: float) -> None:
        if now - child.started_at >= self.backoff.stable_s:
            child.failures = 0
        child.failures += 1
        delay = self.backoff.delay(child.failures)
        child.restart_at = now + delay
        self._log(f"specd up: {child.role} (pid {child.proc.pid}) exited with {_exit_status(child.proc.returncode)}; "
                  f"restarting it in {delay:.1f} s, the other roles keep running")


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
