"""Keep idle CPUs quick to wake: a PM QoS CPU latency request.

Every leg of a round ends by waking a thread that sleeps in epoll. When its
CPU has gone idle, the wake-up pays the CPU's exit from its idle state: on a
virtual machine whose guest halts idle vCPUs (the 2-core dev VM: cpuidle
haltpoll with guest_halt_poll_ns=0), a halt is an exit to the hypervisor and
a wake-up waits for the host to run the vCPU again. `specd overhead` on that
VM: a round's overhead on lanes 1.5 ms, 0.8 ms while idle CPUs poll instead
(docs/benchmarks.md).

Linux lets a process ask for that: writing a 32-bit latency in microseconds
to /dev/cpu_dma_latency and keeping the file open keeps every CPU out of the
idle states slower to leave than that, until the file is closed (the request
ends with the process). 0 makes idle CPUs poll. This is the knob tuned's
latency-performance profile sets; it costs power (idle CPUs spin) and needs
write access to the device (root, or a privileged container), so it is off
unless asked for (`--cpu-wake-latency-us`), and a role that cannot take it
says so and runs on.
"""
from __future__ import annotations

import logging
import os
import struct

log = logging.getLogger(__name__)

DEVICE = "/dev/cpu_dma_latency"

_held: dict[str, int] = {}  # device path -> open descriptor, for the life of the process


def hold(max_us: int, device: str = DEVICE) -> bool:
    """Ask that no CPU sits in an idle state slower than `max_us` to leave,
    for the rest of this process's life (a later call replaces the value).
    Negative: ask nothing. Whether the request is in force."""
    if max_us < 0:
        return False
    try:
        fd = _held.get(device)
        if fd is None:
            fd = os.open(device, os.O_WRONLY)
            _held[device] = fd
        os.write(fd, struct.pack("i", max_us))
    except OSError as exc:
        log.warning("cannot hold the CPU wake-up latency at %d us (%s: %s): idle CPUs keep the machine's idle "
                    "states; this needs write access to %s (root or a privileged container)",
                    max_us, device, exc.strerror or exc, device)
        return False
    log.info("holding the CPU wake-up latency at <= %d us (%s) while this process runs", max_us, device)
    return True


def release(device: str = DEVICE) -> None:
    """End the request (closing the file ends it)."""
    fd = _held.pop(device, None)
    if fd is not None:
        os.close(fd)
