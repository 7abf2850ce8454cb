"""`specd up`'s supervision (`specdec.processes.Supervisor`) with dummy child
processes: a child that exits is restarted with backoff, the others go on,
and stop() ends them all."""
from __future__ import annotations

import os
import signal
import sys

import pytest

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


def test_a_signal_during_the_stop_kills_the_children_instead_of_leaving_them_running():
    """A second Ctrl-C while the children drain (or a SIGTERM) used to raise
    KeyboardInterrupt in the middle of the stop; they were left running."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from specdec.processes import stop_processes

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    procs = [subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, start_new_session=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline() == b"up\n"  # SIGTERM ignored from here on
        original = signal.getsignal(signal.SIGINT)

        def second_ctrl_c():  # once the stop has taken the signals over
            deadline = time.monotonic() + 30
            while signal.getsignal(signal.SIGINT) is original and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=second_ctrl_c, daemon=True).start()
        started = time.monotonic()
        stop_processes(procs, grace_s=60)  # no KeyboardInterrupt out of it
        assert time.monotonic() - started < 30  # not the 60 s grace
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
        assert signal.getsignal(signal.SIGINT) is original
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_role_started_by_the_supervisor_stops_when_its_launcher_is_killed(tmp_path):
    """`specd up` killed with SIGKILL (or by the OOM killer) left its roles
    running; a role that calls die_with_parent (as `specd serve` does) gets
    SIGTERM as its launcher dies."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    child_pid_file = tmp_path / "child.pid"
    role = ("import os, sys, time; from specdec.processes import die_with_parent; die_with_parent(); "
            f"open({str(child_pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    launcher = ("import sys, time; from specdec.processes import Supervisor; "
                f"s = Supervisor(); s.start('role', [sys.executable, '-c', {role!r}]); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", launcher], cwd=os.getcwd(), start_new_session=True)
    child = None
    try:
        deadline = time.monotonic() + 60
        while not (child_pid_file.exists() and child_pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(child_pid_file.read_text())
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the role outlived its launcher"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, reaped by init soon, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_bench_and_soak_roles_are_tied_to_their_launcher_only_from_the_main_thread():
    """spawn_role (bench, soak) ties its children to the launcher as `specd up`
    does; a child forked on a worker thread is not tied, since the kernel would
    stop it as that thread ends."""
    import os
    import threading

    from specdec.processes import DIE_WITH_PARENT_ENV, tied_to_launcher

    base = {"A": "1"}
    assert tied_to_launcher(base) == {"A": "1", DIE_WITH_PARENT_ENV: str(os.getpid())}
    assert base == {"A": "1"}
    seen = []
    worker = threading.Thread(target=lambda: seen.append(tied_to_launcher(base)))
    worker.start()
    worker.join(timeout=30)
    assert seen == [{"A": "1"}]
