"""What else ran while a benchmark did (specdec/bench/machine_load.py), read
from a /proc built in the test."""
from __future__ import annotations

import os

import pytest

from specdec.bench import machine_load
from specdec.bench.machine_load import LoadWatch


class FakeProc:
    """A /proc with a CPU line and processes (pid -> (ppid, user ticks, system ticks))."""

    def __init__(self, root):
        self.root = root
        root.mkdir(exist_ok=True)

    def cpu(self, user, system, idle, steal=0, softirq=0):
        (self.root / "stat").write_text(f"cpu  {user} 0 {system} {idle} 0 0 {softirq} {steal} 0 0\ncpu0 0 0 0 0\n")

    def process(self, pid, ppid, utime, stime, cutime=0, cstime=0, comm="py thon) x"):
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        # comm may hold spaces and parentheses: fields are read after the last ")"
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1 0 0 0 0 0 {utime} {stime} {cutime} {cstime} "
                                "20 0 1 0\n")

    def exit(self, pid):
        d = self.root / str(pid)
        (d / "stat").unlink()
        d.rmdir()


@pytest.fixture
def proc(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_load, "PROC", str(tmp_path / "proc"))
    return FakeProc(tmp_path / "proc")


def test_others_are_what_the_cpus_did_beyond_the_benchmarks_tree(proc):
    proc.cpu(user=1000, system=100, idle=5000)
    proc.process(10, 1, 50, 5)  # the benchmark
    proc.process(11, 10, 30, 3)  # a service it started
    proc.process(12, 11, 0, 0)  # a grandchild
    proc.process(20, 1, 400, 0)  # someone else
    watch = LoadWatch(root=10).start()
    proc.process(10, 1, 150, 5)  # +100
    proc.process(11, 10, 230, 3)  # +200
    proc.process(12, 11, 100, 0)  # +100
    proc.process(20, 1, 700, 0)  # +300, not ours
    proc.cpu(user=1000 + 700, system=100, idle=5000 + 300, softirq=50, steal=50)
    share = watch.stop()
    # 1100 ticks of all CPUs: 700 busy, of which 400 ours; 50 stolen; softirq is no one's
    assert share.others == pytest.approx(300 / 1100)
    assert share.steal == pytest.approx(50 / 1100)
    assert share.busy and "BUSY" in share.line()


def test_a_service_stopped_during_the_run_counts_whole_through_its_parent(proc):
    proc.cpu(user=0, system=0, idle=1000)
    proc.process(10, 1, 0, 0)
    proc.process(11, 10, 40, 0, cutime=20)  # running before the watch: 40 + 20 (a helper it reaped) not this run's
    proc.process(20, 1, 0, 0)  # someone else
    watch = LoadWatch(root=10).start()
    proc.process(12, 10, 50, 0)  # a service started during the run...
    proc.exit(11)  # ...and both stopped and reaped by the benchmark: 40 + 20 + 60 and 50 ticks in its children's
    proc.exit(12)
    proc.process(10, 1, 10, 0, cutime=170)
    proc.process(20, 1, 40, 0)
    proc.cpu(user=160, system=0, idle=1840)  # the tree's 10 + 60 + 50 ticks, and the other's 40
    share = watch.stop()
    assert share.others == pytest.approx(40 / 1000) and share.steal == 0  # of the 1000 ticks of the run
    assert not share.busy and "BUSY" not in share.line()


def test_without_proc_there_is_no_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_load, "PROC", str(tmp_path / "nothing"))
    assert LoadWatch().start().stop() is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc")
def test_this_machine_gives_shares_between_zero_and_one():
    watch = LoadWatch().start()
    end = sum(range(200_000))  # a little work of our own
    share = watch.stop()
    assert end and 0 <= share.others <= 1 and 0 <= share.steal <= 1 and share.cpus >= 1
