"""Services as child processes: start a role as `specd serve ROLE --port 0`
and read the port it bound (`spawn_role`, `read_ports`), wait until one
reports SERVING, keep them running (`Supervisor`: restart with backoff), stop
them all, and read their memory from /proc.

Shared by `specd up` (`specdec.cli.up_cmd`), `specd bench`
(`specdec.bench.services`) and `specd soak` (`specdec.soak.services`), which
all start the roles as child processes.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_LISTENING = re.compile(r"listening on [^\s]*:(\d+)")


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


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 30.0,
                   first: Sequence[subprocess.Popen] = ()) -> None:
    """SIGTERM every process (they drain), then SIGKILL what is left after
    grace_s. Those of `first` are stopped, and waited for, before the others
    are signalled: a front that drains needs its backends meanwhile. A Ctrl-C
    or SIGTERM meanwhile kills them all at once (see `_signals_kill`) rather
    than interrupting the stop."""
    first_ids = {id(p) for p in first}
    stages = [[p for p in procs if id(p) in first_ids], [p for p in procs if id(p) not in first_ids]]
    with _signals_kill(procs):
        for stage in stages:
            for p in stage:
                if p.poll() is None:
                    try:
                        p.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for p in stage:
                try:
                    p.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)


@contextmanager
def _signals_kill(procs: list[subprocess.Popen]):
    """While the children drain: SIGINT and SIGTERM SIGKILL them, and the
    stop goes on. A second Ctrl-C, the usual answer to a slow stop, raised
    KeyboardInterrupt in the middle of it and left the children running,
    each in a session of its own (their models' memory, a GPU's, held). Only
    the main thread can install handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def kill_now(*_):
        print("stopping at once: the remaining children are killed", file=sys.stderr, flush=True)
        for p in procs:
            if p.poll() is None:
                p.kill()

    previous = {sig: signal.signal(sig, kill_now) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def close_stdin_and_wait(process: subprocess.Popen, grace_s: float) -> None:
    """Stop a child that ends when its stdin closes (the benchmarks' helper
    servers): close it, wait up to grace_s, then SIGKILL."""
    if process.poll() is None:
        process.stdin.close()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ------------------------------------------- roles as `specd serve` children


@dataclass
class Service:
    """One role started by `spawn_role`: its process, its log, and the port
    it bound (0 until `read_ports`)."""

    role: str
    proc: subprocess.Popen
    log_path: Path
    command: list[str]
    port: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def describe(self) -> dict:
        return {"role": self.role, "pid": self.pid, "port": self.port, "log": str(self.log_path),
                "command": self.command}


def role_env(base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict:
    """The environment of the roles' children: `base` (default this process's
    environment) with `extra` on top, less OTEL_SERVICE_NAME (each role names itself)."""
    env = {**(os.environ if base is None else base), **(extra or {})}
    env.pop("OTEL_SERVICE_NAME", None)
    return env


def spawn_role(role: str, args: list[str], log_dir: Path, env: dict, name: str = "") -> Service:
    """Start `specd serve ROLE --port 0 ARGS`, its output in LOG_DIR/NAME.log
    (NAME defaults to the role; replicas of one role need their own)."""
    name = name or role
    command = [sys.executable, "-m", "specdec.cli.main", "serve", role, "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", *args]
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "w")
    try:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=tied_to_launcher(env),
                                start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor
    return Service(name, proc, log_path, command)


def read_port(service: Service, timeout_s: float) -> int:
    """The port a service started by `spawn_role` bound, from its log line
    "listening on HOST:PORT"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            match = _LISTENING.search(service.log_path.read_text(errors="replace"))
        except OSError:
            match = None
        if match:
            return int(match.group(1))
        if service.proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log_tail(service.log_path)
    raise RuntimeError(f"the {service.role} service did not start (exit code {service.proc.poll()}); "
                       f"its log {service.log_path} ends with:\n{tail}")


def read_ports(services: Sequence[Service], timeout_s: float = 120.0) -> None:
    """Fill in each service's port (`read_port`), in turn."""
    for service in services:
        service.port = read_port(service, timeout_s)


def wait_all_serving(services: Sequence[Service], watched: Sequence[Service], timeout_s: float,
                     explain: Callable[[], str] | None = None) -> None:
    """Wait until each of `services` reports SERVING, in turn; fail early if
    any of `watched` exits meanwhile. `explain()` (e.g. the logs' tails) is
    added to the error's message."""
    procs = [s.proc for s in watched]
    for service in services:
        try:
            wait_serving(service.port, procs, timeout_s)
        except RuntimeError as exc:
            if explain is None:
                raise
            raise RuntimeError(f"{exc}\n{explain()}") from None


# Set by a launcher that wants its children to stop when it dies, to its pid.
DIE_WITH_PARENT_ENV = "SPECD_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """At a role's start: when its launcher asked (DIE_WITH_PARENT_ENV names
    the launcher's pid), the kernel sends this process SIGTERM (a drain) as
    the launcher dies, however it dies. `specd up` killed with SIGKILL (or by
    the OOM killer) left its three roles running, each in a session of its
    own, holding their models' memory, a GPU's. Linux only; elsewhere, or
    without the variable, nothing."""
    launcher = os.environ.get(DIE_WITH_PARENT_ENV, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl here: the launcher's own stop still works
        return
    if os.getppid() != int(launcher):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def tied_to_launcher(env: Mapping[str, str]) -> dict:
    """`env` for a child that should stop when this process dies
    (`die_with_parent`), as `specd up`'s, bench's and soak's roles should: a
    bench killed with SIGKILL left its roles holding their models' memory.
    The kernel ties that to the thread that forks the child, so only a child
    forked on the main thread (which lives as long as the process) is tied;
    one forked on a worker thread would be stopped as that thread ends."""
    if threading.current_thread() is not threading.main_thread():
        return dict(env)
    return {**env, DIE_WITH_PARENT_ENV: str(os.getpid())}


def stop_services(services: Sequence[Service], grace_s: float = 30.0) -> None:
    """`stop_processes` of services started by `spawn_role`, in the order given."""
    stop_processes([s.proc for s in services], grace_s)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log, or "(no log)"."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def status_mb(pid: int | str, key: str) -> float | None:
    """A size from /proc/PID/status (e.g. "VmRSS", "VmHWM") in MiB; None
    once the process is gone or without the field."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


# ------------------------------------------------------------ supervision


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

    def stop(self, grace_s: float = 30.0, first: Sequence[str] = ()) -> None:
        """Stop every child; the roles in `first` are stopped, and waited
        for, before the others (`stop_processes`)."""
        self._stopped = True
        for child in self.children.values():
            child.restart_at = None
        stop_processes(self.processes, grace_s,
                       first=[c.proc for c in self.children.values() if c.role in first and c.proc is not None])

    def _spawn(self, child: Child) -> None:
        # The children stop when this process dies, however (`die_with_parent`):
        # the kernel ties that to the thread that forks them, and `poll()` runs
        # on its owner's one thread.
        env = tied_to_launcher(child.env if child.env is not None else os.environ)
        child.proc = subprocess.Popen(child.cmd, env=env, start_new_session=True)
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
