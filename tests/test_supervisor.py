"""`specd up`'s supervision (`specdec.processes.Supervisor`) with dummy child
processes: a child that exits is restarted with backoff, the others go on,
and stop() ends them all."""
from __future__ import annotations

import os
import signal
import sys

from specdec.processes import Backoff, Supervisor
from tests.harness import wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
QUITTER = [sys.executable, "-c", "raise SystemExit(3)"]


def test_backoff_doubles_up_to_its_cap():
    b = Backoff(initial_s=0.5, max_s=3.0)
    assert [b.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_killed_child_is_restarted_and_the_others_keep_running():
    lines = []
    sup = Supervisor(Backoff(initial_s=0.1, max_s=0.5), log=lines.append)
    try:
        draft = sup.start("draft", SLEEPER)
        target = sup.start("target", SLEEPER)
        os.kill(draft.pid, signal.SIGKILL)
        wait_until(lambda: (sup.poll(), sup.children["draft"].proc.pid != draft.pid)[1])
        assert target.poll() is None and sup.children["target"].proc is target
        assert sup.children["draft"].proc.poll() is None and sup.children["draft"].restarts == 1
        assert any("draft" in line and "SIGKILL" in line and "restarting" in line for line in lines)
    finally:
        sup.stop(grace_s=5)
    assert all(p.poll() is not None for p in sup.processes)


def test_quick_exits_back_off_and_stop_cancels_pending_restarts():
    now = [0.0]
    sup = Supervisor(Backoff(initial_s=1.0, max_s=4.0, stable_s=60.0), log=lambda _: None, clock=lambda: now[0])
    try:
        first = sup.start("orchestrator", QUITTER)
        first.wait(timeout=20)
        sup.poll()  # exit noticed at t=0: restart due at t=1
        assert sup.children["orchestrator"].proc is first
        now[0] = 1.0
        sup.poll()
        second = sup.children["orchestrator"].proc
        assert second is not first
        second.wait(timeout=20)
        now[0] = 1.5
        sup.poll()  # second quick exit: delay 2 s
        assert sup.children["orchestrator"].restart_at == 3.5
        sup.stop(grace_s=5)
        now[0] = 100.0
        sup.poll()
        assert sup.children["orchestrator"].proc is second  # no restart after stop()
    finally:
        sup.stop(grace_s=5)
