"""A mistake a user can make on `specd`'s command line gets one clear line
and a proper exit status (2 for a usage error), never a traceback and never
a wait that cannot end, and it is caught before anything connects, binds or
starts (a review's findings: request values protobuf refuses, ports past
65535, zero repetitions, NaN durations, and `specd soak` leaving its
children behind on SIGTERM)."""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import orchestrator.client
from specdec.cli import bench_cmd, serve_cmd
from specdec.cli.bench_options import UsageError, resolve
from specdec.cli.exits import EXIT_INTERRUPTED, EXIT_USAGE
from specdec.cli.interrupts import interrupted_by_signals
from specdec.cli.main import build_parser, main
from specdec.latency_proxy import LatencyProxy, parse_address
from specdec.metrics import start_metrics_server
from specdec.rpc.serving import ServerConfig

REPO = Path(__file__).resolve().parent.parent


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """`specd ARGV` in this process: (exit status, stderr); argparse's own
    refusals exit through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def parse_error(argv: list[str], capsys) -> str:
    """What argparse says refusing `specd ARGV` (it exits 2). Only parses: a
    value it let through fails the test at once instead of starting the
    command (unrefused, `specd up --draft-port 99999` waits 15 minutes)."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == EXIT_USAGE
    return capsys.readouterr().err


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


@pytest.fixture
def no_connection(monkeypatch):
    """`specd generate` must refuse before it makes a client."""
    def refuse(*args, **kwargs):
        raise AssertionError("a connection was made")

    monkeypatch.setattr(orchestrator.client, "Client", refuse)


@pytest.fixture
def nothing_served(monkeypatch):
    """`specd serve` must refuse before a role starts (unrefused, one would
    bind a wrapped port, or wait for its target forever)."""
    def refuse(coro):
        coro.close()
        raise AssertionError("the role started")

    monkeypatch.setattr(serve_cmd, "_run", refuse)


# ------------------------------------------------- values of the request


@pytest.mark.parametrize("argv,named", [
    (["--max-tokens", "99999999999", "x"], "--max-tokens: must be in [0, 2147483647]"),
    (["--max-tokens", "-1", "x"], "--max-tokens: must be in [0, 2147483647]"),
    (["--seed", "-1", "x"], "--seed: must be in [0, 18446744073709551615]"),
    (["--seed", str(2**64), "x"], "--seed: must be in [0, 18446744073709551615]"),
    (["--top-k", "9999999999", "x"], "--top-k: must be in [0, 2147483647]"),
    (["--num-draft-tokens", "5000000000", "x"], "--num-draft-tokens: must be in [0, 2147483647]"),
    (["--prompt-ids", "1,99999999999"], "--prompt-ids: token ids must be in [0, 2147483647], got 99999999999"),
    (["--prompt-ids", "1,-2"], "--prompt-ids: token ids must be in [0, 2147483647], got -2"),
    # Bytes that are not UTF-8 ($'caf\xe9' from bash) reach Python as lone surrogates.
    (["caf\udce9"], "argument prompt: the text is not valid UTF-8 (byte 0xe9 at character 3)"),
    (["--stop", "\udcff", "x"], "--stop: the text is not valid UTF-8 (byte 0xff at character 0)"),
    (["--policy", "\udcff", "x"], "--policy: the text is not valid UTF-8"),
    (["--timeout", "nan", "x"], "--timeout: must be a finite number >= 0, got nan"),
    (["--wait", "-1", "x"], "--wait: must be a finite number >= 0"),
])
def test_generate_refuses_what_the_request_cannot_carry(capsys, no_connection, argv, named):
    rc, err = run_cli(["generate", *argv], capsys)
    assert rc == EXIT_USAGE
    assert last_line(err).startswith("specd generate: error: argument ") and named in err, err


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_generate_refuses_standard_input_that_is_not_utf8(capsys, monkeypatch, no_connection, errors):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"), encoding="utf-8", errors=errors))
    rc, err = run_cli(["generate", "--chat", "-"], capsys)
    assert rc == EXIT_USAGE
    assert last_line(err).startswith("specd generate: error: standard input is not valid UTF-8"), err


def test_generate_refuses_undecodable_argument_bytes_in_a_real_process():
    """The bytes themselves on a real command line: no traceback, exit 2."""
    out = subprocess.run([sys.executable, "-m", "specdec.cli.main", "generate", "--server", "127.0.0.1:1",
                          b"caf\xe9"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == EXIT_USAGE, out.stderr
    assert "Traceback" not in out.stderr and "is not valid UTF-8 (byte 0xe9" in out.stderr


@pytest.mark.parametrize("flags,named", [
    (["--seed", "-5"], "--seed must be in [0, 18446744073709551614]"),
    (["--seed", str(2**64 - 1)], "--seed must be in [0, 18446744073709551614] (prompt i is sent seed + i)"),
    (["--max-tokens", "99999999999"], "--max-tokens must be in [1, 2147483647]"),
    (["--temperatures", "nan"], "--temperatures must be finite"),
])
def test_bench_refuses_request_values_before_it_starts_anything(tmp_path, flags, named):
    """resolve() is all that runs before `specd bench` starts the services."""
    args = build_parser().parse_args(["bench", "--pair", "tiny", "--quick", "--out", str(tmp_path / "out"), *flags])
    with pytest.raises(UsageError, match="^" + re.escape(named)):
        resolve(args)


def test_bench_reports_a_usage_error_with_exit_2(tmp_path, capsys, monkeypatch):
    def refuse(*args):
        raise AssertionError("the bench started")

    monkeypatch.setattr(bench_cmd, "_run", refuse)
    rc, err = run_cli(["bench", "--pair", "tiny", "--quick", "--seed", "-5", "--out", str(tmp_path / "out")], capsys)
    assert rc == EXIT_USAGE and last_line(err).startswith("specd bench: error: --seed must be in [0, ")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------- ports


@pytest.mark.parametrize("role,flag", [
    ("orchestrator", "--port=99999"), ("orchestrator", "--port=-5"), ("orchestrator", "--port=65536"),
    ("orchestrator", "--health-port=65536"), ("orchestrator", "--health-port=-2"),
    ("orchestrator", "--metrics-port=99999"), ("orchestrator", "--metrics-port=-1"),
    ("draft", "--lane-port=70000"), ("target", "--port=99999"),
])
def test_serve_refuses_a_port_out_of_range(capsys, nothing_served, role, flag):
    rc, err = run_cli(["serve", role, flag], capsys)
    name = flag.split("=")[0]
    assert rc == EXIT_USAGE
    assert last_line(err).startswith(f"specd serve {role}: error: {name} must be ") and "up to 65535" in err, err


@pytest.mark.parametrize("field,value", [("port", 65536), ("port", -1), ("metrics_port", 99999),
                                         ("health_port", -2), ("lane_port", 70000)])
def test_server_config_refuses_a_port_out_of_range(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be .* up to 65535, got {value}"):
        ServerConfig(**{field: value})


def test_server_config_keeps_its_special_ports():
    cfg = ServerConfig(port=0, metrics_port=0, health_port=-1, lane_port=-1)
    assert (cfg.port, cfg.health_port, cfg.lane_port) == (0, -1, -1)
    assert ServerConfig(port=65535, health_port=0, lane_port=65535).port == 65535


@pytest.mark.parametrize("argv,named", [
    (["up", "--draft-port", "99999"], "--draft-port: must be in [1, 65535]"),
    (["up", "--target-port", "-5"], "--target-port: must be in [1, 65535]"),
    (["up", "--port", "0"], "--port: must be in [1, 65535] (specd up waits on it: not 0)"),
    (["up", "--metrics-port", "65534"], "--metrics-port: must be in [0, 65533]"),
    (["up", "--http-port", "99999"], "--http-port: must be in [-1, 65535]"),
    (["proxy", "--upstream", "127.0.0.1:1", "--listen-port", "99999"], "--listen-port: must be in [0, 65535]"),
    (["proxy", "--upstream", "127.0.0.1:1", "--listen-port", "-1"], "--listen-port: must be in [0, 65535]"),
])
def test_port_flags_take_0_to_65535(capsys, argv, named):
    err = parse_error(argv, capsys)
    assert last_line(err).startswith(f"specd {argv[0]}: error: argument ") and named in err, err


def test_the_proxy_and_the_metrics_server_refuse_a_port_out_of_range(capsys, monkeypatch):
    with pytest.raises(ValueError, match="up to 65535, got 99999"):
        LatencyProxy("127.0.0.1:1", port=99999)
    with pytest.raises(ValueError, match=r"must be in \[1, 65535\]"):
        parse_address("127.0.0.1:99999")
    with pytest.raises(ValueError, match="the metrics port must be .* up to 65535, got 99999"):
        start_metrics_server("127.0.0.1", 99999, registry=None)
    def refuse(self):
        raise AssertionError("the proxy started")

    monkeypatch.setattr(LatencyProxy, "start", refuse)
    rc, err = run_cli(["proxy", "--upstream", "127.0.0.1:70000"], capsys)
    assert rc == EXIT_USAGE and last_line(err) == "specd proxy: error: the port of '127.0.0.1:70000' must be in [1, 65535]"


# ----------------------------------------------- counts, files, durations


@pytest.mark.parametrize("argv,named", [
    (["overhead", "--in-process", "--reps", "0"], "argument --reps: must be at least 1, got 0"),
    (["steps", "synth:tiny", "--repeat", "0"], "argument --repeat: must be at least 1, got 0"),
    (["steps", "synth:tiny", "--context", "0"], "argument --context: must be at least 1, got 0"),
    (["steps", "synth:tiny", "--batches", "0"], "argument --batches: must be at least 1, got 0"),
    (["up", "--startup-timeout", "nan"], "argument --startup-timeout: must be a finite number >= 0, got nan"),
    (["up", "--restart-backoff-s", "-1"], "argument --restart-backoff-s: must be a finite number >= 0, got -1"),
    (["soak", "--seconds", "inf"], "argument --seconds: must be a finite number >= 0, got inf"),
    (["proxy", "--upstream", "127.0.0.1:1", "--delay-ms", "nan"],
     "argument --delay-ms: must be a finite number >= 0, got nan"),
])
def test_counts_and_durations_are_checked_by_the_parser(capsys, argv, named):
    err = parse_error(argv, capsys)
    assert last_line(err) == f"specd {argv[0]}: error: {named}", err


@pytest.mark.parametrize("flag,named", [
    ("--connect-timeout-s=nan", "--connect-timeout-s must be a finite number >= 0, got nan"),
    ("--rpc-timeout-s=-1", "--rpc-timeout-s must be a finite number >= 0, got -1.0"),
    ("--drain-grace-s=inf", "--drain-grace-s must be a finite number >= 0, got inf"),
    ("--http-request-timeout-s=nan", "--http-request-timeout-s must be a finite number >= 0, got nan"),
    ("--default-max-tokens=0", "--default-max-tokens must be at least 1, got 0"),
    ("--max-tokens-limit=0", "--max-tokens-limit must be at least 1, got 0"),
    ("--default-max-tokens=9000", "--default-max-tokens (9000) must be at most --max-tokens-limit (8192)"),
])
def test_serve_orchestrator_refuses_settings_that_cannot_work(capsys, nothing_served, flag, named):
    rc, err = run_cli(["serve", "orchestrator", flag], capsys)
    assert rc == EXIT_USAGE and last_line(err).startswith(f"specd serve orchestrator: error: {named}"), err


def test_serve_target_refuses_a_nan_session_ttl(capsys, nothing_served):
    rc, err = run_cli(["serve", "target", "--session-ttl-s", "nan"], capsys)
    assert rc == EXIT_USAGE and last_line(err) == \
        "specd serve target: error: --session-ttl-s must be a finite number >= 0, got nan"


@pytest.mark.parametrize("flags", [["--ngram-min", "4", "--ngram-max", "3"], ["--ngram-min", "0"],
                                   ["--ngram-max", "0"]])
def test_serve_draft_refuses_an_ngram_range_that_matches_nothing(capsys, nothing_served, flags):
    """min past max, or 0: the drafter proposed nothing, every round."""
    rc, err = run_cli(["serve", "draft", "--drafter", "ngram", *flags], capsys)
    assert rc == EXIT_USAGE and last_line(err).startswith(
        "specd serve draft: error: --ngram-min and --ngram-max must satisfy 1 <= min <= max"), err


@pytest.mark.parametrize("value", ["0", "2049", "151936"])
def test_serve_draft_refuses_a_q_that_would_not_fit_a_verify(capsys, nothing_served, value):
    """A q of the whole vocabulary made a batched Verify too large to send."""
    rc, err = run_cli(["serve", "draft", "--max-q-tokens", value], capsys)
    assert rc == EXIT_USAGE and last_line(err) == (
        "specd serve draft: error: --max-q-tokens must be between 1 and 2048 (a Verify of several sessions "
        f"must fit in one message), got {value}"), err


def test_trace_refuses_a_directory_or_a_file_that_is_not_text(tmp_path, capsys):
    for action in ("list", "show"):
        rc, err = run_cli(["trace", action, "--file", str(tmp_path)], capsys)
        assert rc == 1 and last_line(err) == f"specd trace: {tmp_path} is a directory: give the trace file " \
                                            "(a .jsonl file) itself"
    binary = tmp_path / "traces.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    rc, err = run_cli(["trace", "list", "--file", str(binary)], capsys)
    assert rc == 1 and last_line(err) == f"specd trace: {binary} is not a trace file (not UTF-8 text)"


# ------------------------------------------------------ SIGTERM and soak


def test_interrupted_by_signals_turns_sigterm_into_keyboard_interrupt():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with interrupted_by_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; this is never reached in full
    assert signal.getsignal(signal.SIGTERM) is before


def _children(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
@pytest.mark.timeout(120)
def test_soak_stops_its_children_on_sigterm(tmp_path):
    """`timeout 60 specd soak ...` sends SIGTERM to the soak alone (its
    children run in sessions of their own): the soak stops them, and exits
    130. Sent once all three roles are started (the orchestrator starts once
    the models have bound their ports)."""
    soak = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "soak", "--draft-model", "synth:tiny",
                             "--target-model", "synth:tiny", "--streams", "1", "--seconds", "60",
                             "--logs", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 3 and soak.poll() is None and time.monotonic() < deadline:
            seen |= _children(soak.pid)
            time.sleep(0.05)
        assert len(seen) == 3, f"the soak did not start its three roles: {soak.poll()}"
        soak.send_signal(signal.SIGTERM)
        _, err = soak.communicate(timeout=45)
        assert soak.returncode == EXIT_INTERRUPTED, err
        assert "specd soak: interrupted; the services were stopped" in err and "Traceback" not in err, err
        assert [pid for pid in seen if _alive(pid)] == []
    finally:
        if soak.poll() is None:
            soak.kill()
            soak.wait()
        for pid in seen:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_ipv6_host_is_bound_as_grpc_spells_it():
    """`--host ::` (an IPv6-only cluster's SPECD_HOST) reached grpc as ":::PORT",
    which it cannot bind: every role crash-looped."""
    import asyncio
    import socket

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.rpc.serving import bind_address, start_server

    assert bind_address("::", 50051) == "[::]:50051" and bind_address("0.0.0.0", 1) == "0.0.0.0:1"
    assert bind_address("[::1]", 2) == "[::1]:2" and bind_address("localhost", 3) == "localhost:3"
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def main():
        running = await start_server(ServerConfig(host="::1", port=0), lambda server: None, [])
        try:
            async with grpc.aio.insecure_channel(f"[::1]:{running.port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
        finally:
            await running.drain(0)

    asyncio.run(asyncio.wait_for(main(), 30))
