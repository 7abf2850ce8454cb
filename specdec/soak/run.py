"""One soak run: start the roles, drive the streams (with faults, if asked),
sample every child's RSS meanwhile, drain, read the sessions left open, stop.

    result = run_soak(SoakConfig(streams=32, seconds=60), log_dir)

`specd soak` (specdec/cli/soak_cmd.py) is the command; the CI short form
and the faults-under-load tests call `run_soak` directly.
"""
from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.soak.load import OK, StreamMix, drive, target_only
from specdec.soak.report import rss_growth, split_growth, summarize
from specdec.soak.services import RoleOptions, SoakServices


@dataclass(frozen=True)
class Fault:
    """Send `signal` to the role `name` (draft, target0, ...) `at_s` seconds
    into the load. It is not restarted."""

    name: str
    at_s: float
    signal: str = "SIGKILL"  # or SIGTERM: a graceful drain


@dataclass
class SoakConfig:
    draft: str  # model directories (or catalog names)
    target: str
    streams: int = 32
    seconds: float = 60.0  # of load; the drain comes after
    replicas: int = 1
    seed: int = 0
    threads: int = 1
    max_context: int = 1024
    mix: StreamMix = field(default_factory=StreamMix)
    faults: tuple[Fault, ...] = ()
    check_greedy: bool = False  # compare completed greedy streams with target-only decoding
    rss_interval_s: float = 1.0
    settle_s: float = 10.0  # after the drain, wait this long at most for the sessions to close
    orchestrator_flags: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)  # extra environment of the children (e.g. MALLOC_ARENA_MAX)


def run_soak(cfg: SoakConfig, log_dir: Path) -> dict:
    """Run it; always stops the children. The result is JSON-ready."""
    # Sessions: every stream holds one, and a closed one lingers a moment
    # (the orchestrator closes in the background); RESOURCE_EXHAUSTED would be
    # the soak's own mistake, not a finding.
    services = SoakServices(RoleOptions(
        draft=cfg.draft, target=cfg.target, replicas=cfg.replicas, threads=cfg.threads,
        max_context=cfg.max_context, max_sessions=2 * cfg.streams + 16,
        orchestrator_flags=cfg.orchestrator_flags, env=cfg.env), log_dir)
    try:
        services.start()
        return asyncio.run(_run(cfg, services))
    except Exception as exc:
        raise RuntimeError(f"{exc}\n{services.log_tails()}") from exc
    finally:
        services.stop()


async def _run(cfg: SoakConfig, services: SoakServices) -> dict:
    t0 = time.monotonic()
    samples: list[tuple[float, dict]] = []
    breakdowns: list[tuple[float, dict]] = []
    sampler = asyncio.ensure_future(_sample_rss(services, samples, breakdowns, t0, cfg.rss_interval_s))
    injected = [asyncio.ensure_future(_inject(services, fault, t0)) for fault in cfg.faults]
    outcomes = await drive(services.orchestrator_address, cfg.mix, cfg.streams, cfg.seconds, cfg.seed, t0)
    drained_s = time.monotonic() - t0
    sampler.cancel()
    for task in injected:
        task.cancel()
    counts, settle_s = await _settle(services, cfg.settle_s)
    result = {"streams": cfg.streams, "seconds": cfg.seconds, "replicas": cfg.replicas, "seed": cfg.seed,
              "drain_s": round(drained_s - cfg.seconds, 2),
              **summarize(outcomes, drained_s),
              "faults": [asdict(f) for f in cfg.faults],
              "sessions_after_drain": {n: None if c is None else c[0] for n, c in counts.items()},
              "sessions_expired": {n: None if c is None else c[1] for n, c in counts.items()},
              "settle_s": settle_s,
              "exit_codes": {n: s.proc.poll() for n, s in services.services.items() if s.proc.poll() is not None},
              "rss": rss_growth(samples, cfg.seconds),
              "rss_by_mapping": split_growth(breakdowns, cfg.seconds),
              "rss_series": [[round(t, 1), rss] for t, rss in samples],
              "mix": asdict(cfg.mix), "env": cfg.env}
    if cfg.check_greedy:
        greedy = [o for o in outcomes if o.status == OK and o.plan.greedy]
        # As many at once as the load had (four at a time, a fault run's
        # references added ~4 s to its 46-50 s on the dev VM).
        refs = await target_only(services.orchestrator_address, [o.plan for o in greedy], concurrency=cfg.streams)
        mismatched = [o for o, ref in zip(greedy, refs) if o.tokens != ref]
        result["greedy_identity"] = {"checked": len(greedy), "identical": len(greedy) - len(mismatched),
                                     "mismatched": [(o.plan.stream, o.plan.index) for o in mismatched[:10]]}
    return result


async def _sample_rss(services: SoakServices, samples: list, breakdowns: list, t0: float, interval_s: float,
                      every: int = 10) -> None:
    """VmRSS of every child each interval; every `every`-th time also its
    split by mapping (what grew: the KV store's first-touched pages, or the rest)."""
    n = 0
    while True:
        now = time.monotonic() - t0
        samples.append((now, services.rss_mb()))
        if n % every == 0:
            breakdowns.append((now, services.rss_breakdown_mb()))
        n += 1
        await asyncio.sleep(interval_s)


async def _inject(services: SoakServices, fault: Fault, t0: float) -> None:
    await asyncio.sleep(max(0.0, fault.at_s - (time.monotonic() - t0)))
    services.signal(fault.name, getattr(signal, fault.signal))


async def _settle(services: SoakServices, settle_s: float) -> tuple[dict, float]:
    """Session counts once every live model service holds none, or after
    settle_s: sessions are closed in the background after a request ends."""
    start = time.monotonic()
    loop = asyncio.get_running_loop()
    while True:
        counts = await loop.run_in_executor(None, services.session_counts)
        waited = time.monotonic() - start
        if all(c is None or c[0] == 0 for c in counts.values()) or waited >= settle_s:
            return counts, round(waited, 2)
        await asyncio.sleep(0.25)
