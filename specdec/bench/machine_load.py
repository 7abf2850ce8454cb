"""What else ran on the machine while a benchmark did.

On a shared machine a figure taken while other work ran is a different
figure: a round's overhead read 0.55 ms alone and 8.8 ms beside a test run
on the 2-vCPU VM (docs/benchmarks.md, the twenty-second pass). `LoadWatch`
measures, from /proc (Linux), the share of all CPUs' time that processes
outside the benchmark's own process tree used during the run, and the share
the hypervisor stole; `LoadShare.line()` says it beside the figures, with a
warning when either is large enough to move them.

The benchmark's tree is this process and its descendants (the services it
starts), read at the start and at the end: what a live one used (its own
ticks), and what the descendants it reaped used (its children's ticks: a
service stopped during the run is counted whole, through its parent).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

PROC = "/proc"
# A share above this of all CPUs' time, used by others or stolen, can move a figure.
BUSY_SHARE = 0.10


@dataclass(frozen=True)
class LoadShare:
    wall_s: float
    cpus: int
    others: float  # share of all CPUs' time used by processes outside the benchmark's tree
    steal: float  # share stolen by the hypervisor (a VM's neighbours)

    @property
    def busy(self) -> bool:
        return self.others > BUSY_SHARE or self.steal > BUSY_SHARE

    def line(self) -> str:
        text = (f"Other work on this machine during the run ({self.wall_s:.0f} s, {self.cpus} CPUs): processes "
                f"outside this benchmark used {100 * self.others:.0f}% of the CPUs' time, and the hypervisor "
                f"took {100 * self.steal:.0f}% (steal).")
        if self.busy:
            text += (f" BUSY: over {100 * BUSY_SHARE:.0f}% of the machine went elsewhere; these figures are not "
                     "comparable with a quiet run's.")
        return text


def _cpu_ticks() -> tuple[int, int, int]:
    """(busy, steal, total) clock ticks of all CPUs since boot (/proc/stat).
    Busy is time in processes (user, nice, system); interrupt time is left
    out, as /proc/[pid]/stat charges it to no process where the kernel
    accounts it apart (the benchmark's own loopback traffic is mostly softirq
    time). Where it does not, softirq time lands in whichever process ran,
    and "others" may read a little low."""
    with open(f"{PROC}/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = fields
    return user + nice + system, steal, sum(fields)


def _process_ticks() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, its own user + system clock ticks, its reaped
    children's), every process."""
    out = {}
    for name in os.listdir(PROC):
        if not name.isdigit():
            continue
        try:
            with open(f"{PROC}/{name}/stat") as f:
                stat = f.read()
        except OSError:  # it exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
        out[int(name)] = (int(fields[1]), utime + stime, cutime + cstime)
    return out


def _tree(processes: dict[int, tuple[int, int, int]], root: int) -> dict[int, tuple[int, int]]:
    """(own ticks, reaped children's ticks) of `root` and its descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in processes:
            out[pid] = processes[pid][1:]
            todo.extend(children.get(pid, ()))
    return out


def _tree_ticks_since(first: dict[int, tuple[int, int]], now: dict[int, tuple[int, int]]) -> int:
    """What the tree used between two readings: each live process's own and
    reaped ticks since the first reading (0 for those born since), less what
    a process that exited since had used before the first reading, with its
    own reaped children (its parent's reaped ticks now hold all of it)."""
    used = sum(own + reaped - sum(first.get(pid, (0, 0))) for pid, (own, reaped) in now.items())
    return used - sum(own + reaped for pid, (own, reaped) in first.items() if pid not in now)


class LoadWatch:
    """Start it before a benchmark runs, stop it after: a `LoadShare`, or
    None where /proc cannot be read."""

    def __init__(self, root: int | None = None):
        self.root = root if root is not None else os.getpid()
        self._start: tuple[float, tuple[int, int, int], dict] | None = None

    def start(self) -> LoadWatch:
        try:
            self._start = (time.monotonic(), _cpu_ticks(), _tree(_process_ticks(), self.root))
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def stop(self) -> LoadShare | None:
        if self._start is None:
            return None
        try:
            busy, steal, total = _cpu_ticks()
            tree = _tree(_process_ticks(), self.root)
        except (OSError, ValueError, IndexError):
            return None
        started, (busy0, steal0, total0), first = self._start
        elapsed = max(1, total - total0)
        others = max(0, (busy - busy0) - _tree_ticks_since(first, tree))
        return LoadShare(wall_s=time.monotonic() - started, cpus=os.cpu_count() or 1,
                         others=others / elapsed, steal=(steal - steal0) / elapsed)
