"""bench/round_cpu.py: the CPU a round costs each process outside the models
(`specd overhead`'s per-process table)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from specdec import eventloop
from specdec.bench.overhead_report import cpu_table
from specdec.bench.round_cpu import RoundCpu, process_cpu_ns, round_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's schedstat is Linux's")


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_process_cpu_time_counts_its_work_and_a_gone_process_has_none():
    before = process_cpu_ns(os.getpid())
    _burn(0.02)
    assert process_cpu_ns(os.getpid()) - before >= 0.02e9
    assert process_cpu_ns(2**22 + 12345) is None  # above any pid_max: no such process


def test_the_reported_compute_comes_off_the_process_that_ran_it():
    computed: list[tuple[float, float]] = []

    async def one_round():  # 3 ms of CPU, of which the services say 1 ms + 0.5 ms were their models
        _burn(0.003)
        computed.append((0.001, 0.0005))

    cpu = eventloop.run(round_cpu(one_round, computed, {"client and services": os.getpid()},
                                  {"client and services": ("draft", "target")}, rounds=50))
    assert cpu.rounds == 50 and cpu.compute == {"draft": pytest.approx(1000), "target": pytest.approx(500)}
    # At least the 1.5 ms burned outside the models; a little more for the loop and other threads.
    assert 1450 <= cpu.outside["client and services"] < 1450 + 1500
    # A process that runs no service keeps all of its CPU.
    cpu = eventloop.run(round_cpu(one_round, computed, {"client": os.getpid()}, {}, rounds=20))
    assert cpu.outside["client"] >= 2900


def test_the_table_names_each_process_and_sums_them():
    cpu = {"greedy": RoundCpu(300, {"client": 210.4, "draft": 180.0, "target": 120.0},
                              {"draft": 2800.0, "target": 900.0})}
    lines = cpu_table(cpu)
    assert "| round | client | draft | target | sum | the services' compute |" in lines
    assert "| greedy | 210 | 180 | 120 | 510 | draft 2800, target 900 |" in lines
    assert "300 rounds back to back" in lines[0]
    # One process (the services in the measuring one): no sum beside its one column.
    alone = cpu_table({"greedy": RoundCpu(300, {"client and services": 640.2}, {"draft": 2800.0, "target": 900.0})})
    assert "| round | client and services | the services' compute |" in alone
    assert "| greedy | 640 | draft 2800, target 900 |" in alone


def test_a_process_cpu_time_keeps_the_time_of_its_threads_that_ended():
    """Summing the live threads lost a thread's CPU when it ended, so a
    process's figure could go backwards (it did in CI, across a burn of 20 ms)."""
    import threading

    before = process_cpu_ns(os.getpid())
    worker = threading.Thread(target=_burn, args=(0.03,))
    worker.start()
    worker.join()
    assert process_cpu_ns(os.getpid()) - before >= 0.03e9


def test_no_pid_names_the_calling_process():
    """0 and -1 would read the caller's own CPU-time clock in Linux's encoding."""
    assert process_cpu_ns(0) is None and process_cpu_ns(-1) is None
