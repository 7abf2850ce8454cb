"""`specd up` end to end with stand-in roles: each child is a small gRPC
health server on its --port (grpc's default options, as `specd serve`), so
the start-up, the supervision and the stop run as they do for real, in
seconds and without models."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]

FAKE_ROLE = r'''
import os, signal, sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from specdec.processes import die_with_parent
die_with_parent()  # as `specd serve` does: SIGTERM when specd up dies
role = sys.argv[1]


def say(line):  # one write: the three children share specd up's output
    os.write(1, (line + "\n").encode())


port = int(sys.argv[sys.argv.index("--port") + 1])
mode = os.environ.get("FAKE_" + role.upper(), "serve")  # serve | hang (never SERVING)
stop = []


def on_sigterm(*_):
    say(f"fake {role} got SIGTERM")
    stop.append(1)


signal.signal(signal.SIGTERM, on_sigterm)
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
S = health_pb2.HealthCheckResponse
servicer.set("", S.NOT_SERVING if mode == "hang" else S.SERVING)
say(f"fake {role} pid {os.getpid()}")
while not stop:
    time.sleep(0.05)
time.sleep(float(os.environ.get("FAKE_DRAIN_S_" + role.upper(), "0")))  # requests in flight finishing
server.stop(0)
say(f"fake {role} exits")
'''

DRIVER = r'''
import sys
import specdec.cli.up_cmd as up
up._fetch_missing = lambda args: None
up._serve_cmd = lambda role, extra: [sys.executable, sys.argv[1], role, *extra]
from specdec.cli.main import main
sys.exit(main(["up", *sys.argv[2:]]))
'''


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Up:
    """`specd up` with the stand-in roles, its output read line by line."""

    def __init__(self, tmp_path, ports: list[int], env: dict | None = None, extra: tuple = ()):
        role, driver = tmp_path / "fake_role.py", tmp_path / "driver.py"
        role.write_text(FAKE_ROLE)
        driver.write_text(DRIVER)
        port, draft, target = ports
        self.proc = subprocess.Popen(
            [sys.executable, str(driver), str(role), "--port", str(port), "--draft-port", str(draft),
             "--target-port", str(target), "--http-port", "-1", "--restart-backoff-s", "0.2", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, words: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if words in line:
                return line
        raise AssertionError(f"no {words!r} in the output of specd up:\n" + "\n".join(self.lines))

    def pids(self, role: str) -> list[int]:
        return [int(line.split()[-1]) for line in self.lines if line.startswith(f"fake {role} pid ")]

    def finish(self, timeout_s: float = 60) -> int:
        code = self.proc.wait(timeout=timeout_s)
        while (line := self._queue.get(timeout=5)) is not None:
            self.lines.append(line)
        return code

    def kill(self):
        """After a failed test: specd up and every child it printed (each in a session of its own)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        while True:  # the lines not read yet name children too
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        for pid in self.pids("draft") + self.pids("target") + self.pids("orchestrator"):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone(pids: list[int], timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_port_another_server_holds_is_refused_before_anything_starts(tmp_path):
    """grpc binds with SO_REUSEPORT: a role started on a port another gRPC
    server listens on (a `specd up` left running) bound it too, that server
    answered the start-up's health checks, and `specd up` said it served
    while the kernel split the connections between the two."""
    other = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, other)
    taken = other.add_insecure_port("127.0.0.1:0")
    other.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port, draft = free_ports(2)
    up = Up(tmp_path, [port, draft, taken])
    try:
        assert up.finish(timeout_s=120) == 1
        out = "\n".join(up.lines)
        assert f"--target-port {taken} is in use" in out
        assert "fake " not in out and "serving on" not in out  # no role was started
    finally:
        up.kill()
        other.stop(0)


def test_ports_named_twice_are_refused():
    from specdec.cli.up_cmd import _port_problems

    port, = free_ports(1)
    args = build_parser().parse_args(["up", "--port", str(port), "--draft-port", str(port), "--target-port",
                                      str(port + 1 if port < 65535 else port - 1), "--http-port", "-1"])
    assert any(f"are both {port}" in p for p in _port_problems(args))


def test_http_port_0_is_refused_as_specd_up_prints_where_it_serves(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--http-port", "0"])
    assert "--http-port: must be in [-1, 65535]" in capsys.readouterr().err
    assert build_parser().parse_args(["up", "--http-port", "-1"]).http_port == -1


def test_a_role_that_dies_is_restarted_and_sigterm_stops_all_three_the_orchestrator_first(tmp_path):
    """Stopped together, the target went at once while the orchestrator
    drained: its requests in flight failed instead of finishing."""
    up = Up(tmp_path, free_ports(3), env={"FAKE_DRAIN_S_ORCHESTRATOR": "1"})
    try:
        up.wait_for("specd up: serving on")
        pids = {role: up.pids(role) for role in ("draft", "target", "orchestrator")}
        assert all(len(p) == 1 for p in pids.values()), up.lines
        os.kill(pids["draft"][0], signal.SIGKILL)
        up.wait_for("restarting draft")
        up.wait_for("fake draft pid")
        restarted = up.pids("draft")[-1]
        assert restarted != pids["draft"][0] and alive(pids["target"][0]) and alive(pids["orchestrator"][0])
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish() == 0
        assert gone([restarted, pids["target"][0], pids["orchestrator"][0]])
        order = [line for line in up.lines if line.endswith(("got SIGTERM", " exits"))]
        assert order.index("fake orchestrator exits") < order.index("fake target got SIGTERM"), order
        assert order.index("fake orchestrator exits") < order.index("fake draft got SIGTERM"), order
    finally:
        up.kill()


def test_ctrl_c_while_a_role_is_not_ready_stops_every_child(tmp_path):
    up = Up(tmp_path, free_ports(3), env={"FAKE_TARGET": "hang"})
    try:
        up.wait_for("fake target pid")
        up.wait_for("fake draft pid")
        children = up.pids("target") + up.pids("draft")
        up.proc.send_signal(signal.SIGINT)
        assert up.finish() == 0
        assert gone(children), "a child outlived specd up"
        assert not up.pids("orchestrator")
    finally:
        up.kill()


def test_a_role_that_never_becomes_ready_fails_the_start_up(tmp_path):
    up = Up(tmp_path, free_ports(3), env={"FAKE_DRAFT": "hang"}, extra=("--startup-timeout", "3"))
    try:
        assert up.finish(timeout_s=120) == 1
        out = "\n".join(up.lines)
        assert "was not SERVING after 3 s" in out
        assert gone(up.pids("target") + up.pids("draft"))
    finally:
        up.kill()
