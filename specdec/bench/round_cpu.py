"""The CPU time a round costs each process outside the models (`specd overhead`).

A round's overhead is a chain: while one process works on it the others
wait, so the overhead is close to the sum of the CPU each process spends on
the round outside its models' compute. That sum is steadier than the round's
wall time (it does not count a vCPU's wake-up or another tenant's slice), and
it says which process to look at. On a host whose cores are slower for
Python (the GPU hosts so far) it is the part that grows.

Each process's CPU time is the kernel's own account of all its threads,
ended ones included (the process's CPU-time clock, nanoseconds, user and
system alike); the services' compute is what they reported for the same
rounds. Linux only: elsewhere there is no figure.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.interleave import Call


def process_cpu_ns(pid: int) -> int | None:
    """Nanoseconds on a CPU so far, all of the process's threads, those that
    have ended included (None where the kernel does not say: not Linux, or
    the process is gone). Read from the process's CPU-time clock (what
    clock_getcpuclockid gives: ((~pid) << 3) | 2 on Linux); summing its live
    threads' /proc schedstat instead lost a thread's time when it ended, so
    the figure could go backwards."""
    if pid <= 0:  # 0 and -1 would name the calling process's own clock
        return None
    try:
        return time.clock_gettime_ns((~pid << 3) | _CPUCLOCK_SCHED)
    except (OSError, OverflowError, AttributeError):
        pass
    total, tasks = 0, Path(f"/proc/{pid}/task")  # a kernel without process CPU clocks: the live threads
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return None
    for thread in threads:
        try:
            total += int((thread / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total


_CPUCLOCK_SCHED = 2  # Linux's encoding of a process CPU-time clock id: ((~pid) << 3) | this


@dataclass(frozen=True)
class RoundCpu:
    """Microseconds of CPU per round. `outside` by process (the measuring
    process: the client, and the services too when they run in it), each less
    the compute its services reported; `compute` by service; `spent` by
    process, compute included.

    The services time their compute on the wall clock, so where a service
    is descheduled mid-forward (a busy host) its compute reads more than the
    CPU it took and its `outside` reads low, even below zero over a few
    rounds: a figure to read over hundreds of rounds on a quiet host."""

    rounds: int
    outside: dict[str, float]
    compute: dict[str, float]
    spent: dict[str, float] = field(default_factory=dict)

    @property
    def total_outside(self) -> float:
        return sum(self.outside.values())


async def round_cpu(one_round: Call, computed: list[tuple[float, float]], processes: dict[str, int],
                    services: dict[str, tuple[str, ...]], rounds: int) -> RoundCpu | None:
    """Run `one_round` `rounds` times back to back and split the CPU it cost.
    `computed` gets each round's (draft, target) compute in seconds, as the
    services reported it; `processes` names each process's pid; `services`
    says which of "draft" and "target" run in each (their compute is taken
    off that process's CPU)."""
    before = {name: process_cpu_ns(pid) for name, pid in processes.items()}
    if None in before.values():
        return None
    first = len(computed)
    for _ in range(rounds):
        await one_round()
    after = {name: process_cpu_ns(pid) for name, pid in processes.items()}
    if None in after.values():
        return None
    reported = computed[first:]
    compute = {"draft": sum(d for d, _ in reported) / rounds * 1e6,
               "target": sum(t for _, t in reported) / rounds * 1e6}
    spent = {name: (after[name] - before[name]) / rounds / 1e3 for name in processes}
    outside = {name: spent[name] - sum(compute[s] for s in services.get(name, ())) for name in processes}
    return RoundCpu(rounds, outside, compute, spent)


def stack_processes(stack) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """`round_cpu`'s processes and services for a stack of specdec/bench/overhead_stack.py."""
    if hasattr(stack.target, "process"):  # each service in a process of its own
        return ({"client": os.getpid(), "draft": stack.draft.process.pid, "target": stack.target.process.pid},
                {"draft": ("draft",), "target": ("target",)})
    return {"client and services": os.getpid()}, {"client and services": ("draft", "target")}
