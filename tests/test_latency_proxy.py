"""specdec.latency_proxy: a TCP proxy that adds delay, jitter and a bandwidth cap.

Everything is on 127.0.0.1, ports are 0, every socket has a timeout, and every
proxy and server started here is stopped by its fixture. Timing checks are
lower bounds only (a delay is a guaranteed minimum; the machine is shared)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.latency_proxy import LatencyProxy, parse_address

pytestmark = pytest.mark.timeout(60)

T = 10.0  # socket and RPC timeouts, seconds


# ------------------------------------------------------------------ helpers


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        sock = self.request
        sock.settimeout(T)
        try:
            while data := sock.recv(1 << 16):
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo_server():
    """An echo server on 127.0.0.1:<free port>: echoes until EOF, then half-closes."""
    server = _Server(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(T)


@pytest.fixture
def make_proxy():
    """make_proxy(upstream, **kwargs) -> a started LatencyProxy, stopped at teardown."""
    started = []

    def make(upstream: str, **kwargs) -> LatencyProxy:
        proxy = LatencyProxy(upstream, **kwargs)
        started.append(proxy)
        return proxy.start()

    try:
        yield make
    finally:
        for proxy in started:
            proxy.stop()


def connect(address: str) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=T)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(1 << 16, n - got))
        if not chunk:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def echo_through(sock: socket.socket, payload: bytes) -> bytes:
    """Send payload (from a thread, so a large one cannot deadlock) and read its echo."""
    errors = []

    def send():
        try:
            sock.sendall(payload)
        except OSError as exc:  # pragma: no cover - reported below
            errors.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        return recv_exactly(sock, len(payload))
    finally:
        sender.join(T)
        assert not errors, errors


def ping(sock: socket.socket, message: bytes = b"ping") -> float:
    start = time.perf_counter()
    sock.sendall(message)
    assert recv_exactly(sock, len(message)) == message
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ tests


def test_parse_address():
    assert parse_address("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_address("[::1]:7") == ("::1", 7)
    for bad in ("nohost", "host:", ":80", "host:port"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_bad_arguments():
    with pytest.raises(ValueError):
        LatencyProxy("127.0.0.1:1", delay_ms=-1)
    with pytest.raises(ValueError):
        LatencyProxy("127.0.0.1:1", bandwidth_mbps=-5)
    proxy = LatencyProxy("127.0.0.1:1")
    with pytest.raises(RuntimeError):
        _ = proxy.port  # not started
    with pytest.raises(ValueError):
        proxy.set_delay(1.0, jitter_ms=-1)
    proxy.stop()  # never started: a no-op


def test_bytes_round_trip_intact_and_counted(echo_server, make_proxy):
    proxy = make_proxy(echo_server, delay_ms=2)
    assert proxy.address == f"127.0.0.1:{proxy.port}"
    payload = os.urandom(4 * 1024 * 1024 + 123)  # multi-MB, not a multiple of any buffer size
    with connect(proxy.address) as sock:
        assert ping(sock, b"hello") > 0
        assert echo_through(sock, payload) == payload
        sock.shutdown(socket.SHUT_WR)  # the half-close travels to the echo server and back
        assert sock.recv(1) == b""
    assert proxy.bytes_up == len(payload) + 5
    assert proxy.bytes_down == len(payload) + 5


def test_round_trip_gains_twice_the_one_way_delay(echo_server, make_proxy):
    delay_ms = 40
    proxy = make_proxy(echo_server, delay_ms=delay_ms)
    with connect(proxy.address) as sock:
        rtts = [ping(sock) for _ in range(3)]
    assert min(rtts) >= 2 * delay_ms / 1000


def test_jitter_never_reorders(echo_server, make_proxy):
    proxy = make_proxy(echo_server, delay_ms=1, jitter_ms=15)
    messages = [b"%05d;" % i for i in range(150)]
    received = []

    def read_all():
        received.append(recv_exactly(sock, sum(map(len, messages))))

    with connect(proxy.address) as sock:
        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        for msg in messages:  # separate small writes, so the proxy sees many chunks
            sock.sendall(msg)
            time.sleep(0.002)
        reader.join(T)
    assert received and received[0] == b"".join(messages)


def test_bandwidth_cap_bounds_throughput(echo_server, make_proxy):
    mbps = 20.0
    proxy = make_proxy(echo_server, bandwidth_mbps=mbps)
    payload = os.urandom(1 << 20)
    with connect(proxy.address) as sock:
        start = time.perf_counter()
        assert echo_through(sock, payload) == payload
        elapsed = time.perf_counter() - start
    assert elapsed >= len(payload) * 8 / (mbps * 1e6)  # 0.42 s of serialization, at least


def test_set_delay_applies_to_later_data(echo_server, make_proxy):
    proxy = make_proxy(echo_server, delay_ms=0, jitter_ms=1)
    with connect(proxy.address) as sock:
        ping(sock)
        proxy.set_delay(50)  # jitter left as it was
        assert (proxy.delay_ms, proxy.jitter_ms) == (50, 1)
        assert ping(sock) >= 0.100
        proxy.set_delay(0, jitter_ms=0)
        assert (proxy.delay_ms, proxy.jitter_ms) == (0, 0)
        ping(sock)


def test_set_delay_from_another_thread_keeps_order(echo_server, make_proxy):
    """Lowering the delay while data is in flight must not let new data overtake old."""
    proxy = make_proxy(echo_server, delay_ms=60)
    with connect(proxy.address) as sock:
        sock.sendall(b"first;")
        threading.Thread(target=proxy.set_delay, args=(0,)).start()
        time.sleep(0.01)
        sock.sendall(b"second;")
        assert recv_exactly(sock, 13) == b"first;second;"


def test_stop_closes_live_connections_and_is_idempotent(echo_server, make_proxy):
    proxy = make_proxy(echo_server)
    address = proxy.address
    with connect(address) as sock:
        ping(sock)
        proxy.stop()
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass  # closed either way
    proxy.stop()
    proxy.stop()
    with pytest.raises(OSError):  # the listener is gone
        connect(address).close()
    with pytest.raises(RuntimeError):
        proxy.start()


def test_port_in_use_raises_on_start(echo_server, make_proxy):
    first = make_proxy(echo_server)
    second = LatencyProxy(echo_server, port=first.port)
    with pytest.raises(OSError):
        second.start()
    second.stop()
    with connect(first.address) as sock:  # the first one is unaffected
        ping(sock)


def test_context_manager(echo_server):
    with LatencyProxy(echo_server, delay_ms=1) as proxy, connect(proxy.address) as sock:
        ping(sock)
    proxy.stop()  # again: harmless


def test_unreachable_upstream_closes_the_client(make_proxy, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    proxy = make_proxy(f"127.0.0.1:{free_port()}", delay_ms=1)
    for _ in range(2):
        with connect(proxy.address) as sock:
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
    proxy.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Traceback" not in capfd.readouterr().err


def test_client_reset_is_handled_quietly(echo_server, make_proxy, caplog):
    caplog.set_level(logging.DEBUG)
    proxy = make_proxy(echo_server, delay_ms=5)
    sock = connect(proxy.address)
    ping(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    sock.sendall(b"x" * 1000)
    sock.close()
    time.sleep(0.1)
    with connect(proxy.address) as sock:  # still serving
        ping(sock)
    proxy.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_grpc_through_the_proxy(make_proxy):
    from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
    from tests.conftest import tiny_engine
    from tests.harness import running_target

    engine = tiny_engine("llama")
    with running_target(engine) as (service, direct, _loop):
        proxy = make_proxy(f"127.0.0.1:{service.port}", delay_ms=5, jitter_ms=2)
        channel = grpc.insecure_channel(proxy.address)
        try:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=T, wait_for_ready=True)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=T).info
            assert info == direct.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=T).info
            # many concurrent streams over the one long-lived connection
            futures = [stub.GetModelInfo.future(common_pb2.GetModelInfoRequest(), timeout=T) for _ in range(20)]
            assert all(f.result().info.vocab_size == info.vocab_size for f in futures)
            opened = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[5, 6, 7]), timeout=T)
            result = stub.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
                session_id=opened.session_id, draft_token_ids=[8, 9])]), timeout=T).results[0]
            assert not result.HasField("error") and result.length == 5
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id), timeout=T)
        finally:
            channel.close()
        assert proxy.bytes_up > 0 and proxy.bytes_down > 0


def test_cli_runs_until_sigterm(echo_server):
    from specdec.cli import proxy_cmd

    parser = argparse.ArgumentParser()
    proxy_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["proxy", "--upstream", echo_server, "--delay-ms", "3", "--jitter-ms", "1"])
    assert (args.listen_port, args.host, args.bandwidth_mbps) == (0, "127.0.0.1", 0.0)

    code = ("import argparse, sys; from specdec.cli import proxy_cmd; p = argparse.ArgumentParser(); "
            "proxy_cmd.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    proc = subprocess.Popen([sys.executable, "-c", code, "proxy", "--listen-port", "0", "--upstream", echo_server,
                             "--delay-ms", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), address
        with connect(address) as sock:
            assert ping(sock) >= 0.006
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=T)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(T)
