"""Which I/O engine grpc's core runs under: chosen before grpc starts, for
every process of the roles (`import specdec` does it).

grpcio 1.80 moved Python onto grpc's EventEngine (its `event_engine_client`,
`event_engine_listener` and `event_engine_for_all_other_endpoints`
experiments are on by default since). Under it, a message that reaches a
grpc.aio process is read by an EventEngine thread, handed to grpc's
completion-queue poller thread, and from there to the event loop: one thread
wake-up more per message than under grpc's older I/O manager (iomgr), where
the poller thread reads the socket itself. On a round's four legs that hop is
measurable: on the 2-core dev VM one message each way on an open stream
costs about 0.3 ms under EventEngine and 0.2 ms under iomgr, and a round's
two messages sent after idle waits (as a round sends them) about 1.1 vs
0.7 ms (`specd overhead` prints both engines' bare figures in one run).

So unless told otherwise, the roles turn those three experiments off:

- `SPECD_GRPC_IO=iomgr` (the default): as above;
- `SPECD_GRPC_IO=event-engine`: leave grpc's default alone;
- a `GRPC_EXPERIMENTS` set by the user is always left as it is.

grpc reads `GRPC_EXPERIMENTS` once, when it first initialises (the first
channel or server, not `import grpc`), so this must run before any channel or
server is built. grpc plans to retire these experiments; a grpcio without
them logs "Unknown experiment" once at start-up and runs EventEngine.
"""
from __future__ import annotations

import os

ENV = "SPECD_GRPC_IO"
IOMGR = "iomgr"
EVENT_ENGINE = "event-engine"
CHOICES = (IOMGR, EVENT_ENGINE)
# grpc's experiments that route Python's I/O through EventEngine.
EVENT_ENGINE_EXPERIMENTS = ("event_engine_client", "event_engine_listener", "event_engine_for_all_other_endpoints")


def chosen(env=None) -> str:
    """The I/O engine `SPECD_GRPC_IO` asks for; ValueError on an unknown one."""
    env = os.environ if env is None else env
    value = env.get(ENV, IOMGR).strip().lower() or IOMGR
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(CHOICES)}")
    return value


def choose(env=None) -> str:
    """Set `GRPC_EXPERIMENTS` in `env` (default: this process's environment,
    so child processes inherit it) for the chosen engine; returns the engine
    grpc will run ("user" when GRPC_EXPERIMENTS was already set)."""
    env = os.environ if env is None else env
    if "GRPC_EXPERIMENTS" in env:
        return "user"
    try:
        engine = chosen(env)
    except ValueError:
        engine = IOMGR  # reported where the CLI reads its settings; never fail an import
    if engine == IOMGR:
        env["GRPC_EXPERIMENTS"] = ",".join(f"-{name}" for name in EVENT_ENGINE_EXPERIMENTS)
    return engine


def runs_event_engine(env=None) -> bool:
    """Whether this process's grpc runs its default EventEngine (no
    GRPC_EXPERIMENTS set: SPECD_GRPC_IO=event-engine)."""
    return (os.environ if env is None else env).get("GRPC_EXPERIMENTS") is None


def describe(env=None) -> str:
    """The engine this process's grpc runs, for reports."""
    env = os.environ if env is None else env
    if runs_event_engine(env):
        return "grpc EventEngine (grpcio's default)"
    experiments = env["GRPC_EXPERIMENTS"]
    off = {name.strip().lstrip("-") for name in experiments.split(",") if name.strip().startswith("-")}
    if off >= set(EVENT_ENGINE_EXPERIMENTS):
        return "grpc iomgr (EventEngine experiments off)"
    return f"GRPC_EXPERIMENTS={experiments}"
