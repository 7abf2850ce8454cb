"""A role still starting (importing torch, loading its model, waiting for
its backends) ends at once on SIGTERM or SIGINT: it serves nothing yet, and
as PID 1 of a container with no init process, a SIGTERM with no handler is
ignored, so kubelet waited out the whole grace period to delete a pod that
was still starting (specdec/cli/serve_cmd.py `_exiting_at_once_on_signals`)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_orchestrator_waiting_for_its_backends_exits_at_once_on_a_signal(sig, tmp_path):
    log = tmp_path / "orchestrator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "serve", "orchestrator",
                                 "--target", f"127.0.0.1:{_free_port()}", "--draft", "", "--port", "0",
                                 "--connect-timeout-s", "600"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while b"listening on" not in log.read_bytes():  # bound, now waiting for a target that never answers
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(sig)
        rc = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text()
    assert rc == 128 + sig, (rc, text)  # its own exit, not the signal's default action (-sig)
    assert f"{sig.name} while starting: exiting at once" in text, text
