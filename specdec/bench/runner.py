"""What the benchmark runs, in which order, and the per-request records.

A *config* is one way of decoding (configs.py), each service config with its
route (the orchestrator of its draft head and batcher setting). A *unit* is one
measured piece of work: one request at concurrency 1, or a wave of requests
sent by c client threads at once. The schedule interleaves configs so a
drifting machine does not favour one of them:

    for each network condition (proxy delays changed in place):
      for each repeat:
        for each temperature:
          concurrency 1:  for each prompt: every config, in an order rotated
                          by (repeat + prompt index)
          (configs that run only in waves, batcher off, are left out)
          concurrency c:  every service config (rotated by repeat), one wave
                          each: the prompts, cycled up to a multiple of c,
                          pulled from one queue by c client threads

The HF baselines run in-process, one stream, so only at concurrency 1 and
only under the first network condition (no network is involved).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Callable, Sequence

from specdec.bench.configs import (  # noqa: F401 - re-exported: the bench's config vocabulary
    BASELINES,
    HF,
    HF_ASSISTED,
    HF_KINDS,
    HF_STATIC,
    PIPELINE_SUFFIX,
    SERVICE,
    TARGET_ONLY,
    BenchConfig,
    Route,
    build_configs,
    routes,
    with_variants,
)

# Errors that mean "this orchestrator does not support the config" (an unknown
# policy, say): the config is skipped for the rest of the run.
UNSUPPORTED_CODES = ("INVALID_ARGUMENT", "UNIMPLEMENTED")


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int
    kind: str  # humaneval | chat | tokens
    token_ids: tuple[int, ...]
    seed: int
    label: str = ""


@dataclasses.dataclass(frozen=True)
class NetworkCondition:
    """Round-trip times added between the orchestrator and each service;
    None: no proxy at all (direct connections)."""

    name: str
    draft_rtt_ms: float | None = None
    target_rtt_ms: float | None = None
    jitter_ms: float = 0.0

    @property
    def proxied(self) -> bool:
        return self.draft_rtt_ms is not None or self.target_rtt_ms is not None

    def one_way_delays_ms(self) -> dict[str, float]:
        """The proxies apply their delay in each direction: RTT X is X/2 each way."""
        return {"draft": (self.draft_rtt_ms or 0.0) / 2.0, "target": (self.target_rtt_ms or 0.0) / 2.0}

    def to_json(self) -> dict:
        return {"network": self.name, "draft_rtt_ms": self.draft_rtt_ms, "target_rtt_ms": self.target_rtt_ms,
                "jitter_ms": self.jitter_ms}


DIRECT = NetworkCondition("direct")


def network_conditions(rtt_ms: Sequence[float] | None, draft_rtt_ms: float | None, target_rtt_ms: float | None,
                       jitter_ms: float = 0.0) -> list[NetworkCondition]:
    """The network conditions to sweep: a list of RTTs (each for both
    services), or one condition with per-service RTTs, or direct."""
    if rtt_ms:
        return [NetworkCondition(f"rtt {_fmt(r)} ms", r, r, jitter_ms) for r in rtt_ms]
    if draft_rtt_ms is not None or target_rtt_ms is not None or jitter_ms:
        d, t = draft_rtt_ms or 0.0, target_rtt_ms or 0.0
        name = f"rtt {_fmt(d)} ms" if d == t else f"draft rtt {_fmt(d)} ms, target rtt {_fmt(t)} ms"
        return [NetworkCondition(name, d, t, jitter_ms)]
    return [DIRECT]


def _fmt(x: float) -> str:
    return f"{x:g}"


@dataclasses.dataclass
class Plan:
    configs: list[BenchConfig]
    prompts: list[Prompt]
    temperatures: list[float]
    concurrency: list[int]
    repeats: int
    conditions: list[NetworkCondition]
    max_tokens: int
    # Service configs that also run at concurrency > 1 (None: all of them).
    concurrency_configs: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class Unit:
    id: int
    condition: int
    repeat: int
    temperature: float
    concurrency: int
    config: BenchConfig
    jobs: tuple[Prompt, ...]


def _rotate(items: Sequence, by: int) -> list:
    if not items:
        return []
    by %= len(items)
    return list(items[by:]) + list(items[:by])


def runs_in_waves(cfg: BenchConfig, concurrency_configs: Sequence[str] | None) -> bool:
    """Whether a service config also runs at concurrency > 1: all do when no
    list is given; a listed name matches the config's full name or its base
    name (then every head and batcher variant of it runs)."""
    return concurrency_configs is None or cfg.name in concurrency_configs or cfg.base in concurrency_configs


def schedule(plan: Plan) -> list[Unit]:
    """Every unit in the order they run (see the module docstring)."""
    units: list[Unit] = []
    for ci, _cond in enumerate(plan.conditions):
        configs = [c for c in plan.configs if c.kind == SERVICE or ci == 0]
        wave_configs = [c for c in configs if c.kind == SERVICE and runs_in_waves(c, plan.concurrency_configs)]
        configs = [c for c in configs if not c.waves_only]
        for rep in range(plan.repeats):
            for temp in plan.temperatures:
                for conc in plan.concurrency:
                    if conc == 1:
                        for p in plan.prompts:
                            for cfg in _rotate(configs, rep + p.index):
                                units.append(Unit(len(units), ci, rep, temp, 1, cfg, (p,)))
                    else:
                        n = max(len(plan.prompts), conc)
                        n = -(-n // conc) * conc
                        jobs = tuple(plan.prompts[i % len(plan.prompts)] for i in range(n))
                        for cfg in _rotate(wave_configs, rep):
                            units.append(Unit(len(units), ci, rep, temp, conc, cfg, jobs))
    return units


# --------------------------------------------------------------- execution


def _is_repeated(field) -> bool:
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == field.LABEL_REPEATED


def stats_to_dict(stats) -> dict | None:
    """GenerateStats as plain JSON (field names as in the proto; finish_reason by name)."""
    if stats is None:
        return None
    out: dict = {}
    for field in stats.DESCRIPTOR.fields:
        value = getattr(stats, field.name)
        if field.name == "k":
            out["k"] = {"min": value.min, "max": value.max, "mean": value.mean, "histogram": list(value.histogram)}
        elif field.name == "finish_reason":
            out[field.name] = field.enum_type.values_by_number[value].name.removeprefix("FINISH_REASON_").lower()
        elif _is_repeated(field):
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def _service_request(client, cfg: BenchConfig, prompt: Prompt, temperature: float, max_tokens: int) -> dict:
    import grpc

    arrivals: list[tuple[float, int]] = []
    tokens: list[int] = []
    error = code = None
    start = time.perf_counter()
    try:
        for chunk in client.generate(list(prompt.token_ids), max_tokens=max_tokens, temperature=temperature,
                                     seed=prompt.seed, request_id=f"bench-{cfg.name}-{prompt.index}",
                                     **cfg.request_kwargs()):
            if chunk.token_ids:
                arrivals.append((time.perf_counter() - start, len(chunk.token_ids)))
                tokens.extend(chunk.token_ids)
        stats = stats_to_dict(client.last_stats)
    except grpc.RpcError as exc:
        stats = None
        code = exc.code().name if exc.code() is not None else "UNKNOWN"
        error = f"{code}: {exc.details()}"
    wall = time.perf_counter() - start
    return {"ok": error is None, "error": error, "error_code": code, "token_ids": tokens, "wall_s": wall,
            "ttft_s": arrivals[0][0] if arrivals else None, "arrivals": arrivals, "stats": stats,
            "finish_reason": stats["finish_reason"] if stats else None}


class Runner:
    """Runs a plan against running services and/or the in-process HF models."""

    def __init__(self, plan: Plan, *, services=None, hf=None, request_timeout_s: float = 3600.0,
                 progress: bool = True, on_record: Callable[[dict], None] | None = None, log=print):
        self.plan = plan
        self.services = services
        self.hf = hf
        self.request_timeout_s = request_timeout_s
        self.progress = progress
        self.on_record = on_record
        self.log = log
        self.records: list[dict] = []
        self.skipped: dict[str, str] = {}
        self._clients: dict = {}  # (route, i) -> Client
        self._lock = threading.Lock()

    # ------------------------------------------------------------ public

    def warm_up(self) -> None:
        """One short request per path, not recorded, so lazy initialization
        (first-call allocations, channel set-up) is not measured."""
        prompt = self.plan.prompts[0]
        kinds = {c.kind for c in self.plan.configs}
        if SERVICE in kinds and self.services is not None:
            for route in routes(self.plan.configs):
                spec = any(c.speculative and c.route == route for c in self.plan.configs)
                for cfg in [BenchConfig(TARGET_ONLY, SERVICE, "none")] + ([BenchConfig("warm-up", SERVICE, "fixed", 2)]
                                                                          if spec else []):
                    _service_request(self._client(route, 0), cfg, prompt, 0.0, 4)
        if self.hf is not None:
            for kind in HF_KINDS:
                if kind in kinds:  # a static cache compiles here, not in a measured request
                    self.hf.generate(list(prompt.token_ids), max_tokens=4, temperature=0.0, seed=0, kind=kind)

    def run(self) -> list[dict]:
        from tqdm import tqdm

        units = schedule(self.plan)
        total = sum(len(u.jobs) for u in units)
        bar = tqdm(total=total, disable=not self.progress, unit="req", dynamic_ncols=True, desc="specd bench")
        current = None
        try:
            for unit in units:
                if unit.condition != current:
                    current = unit.condition
                    cond = self.plan.conditions[current]
                    if cond.proxied and self.services is not None:
                        self.services.set_delays(cond.one_way_delays_ms())
                if unit.config.name in self.skipped:
                    bar.update(len(unit.jobs))
                    continue
                bar.set_postfix_str(f"{unit.config.name} T={unit.temperature:g} c={unit.concurrency} "
                                    f"{self.plan.conditions[unit.condition].name}", refresh=False)
                for record in self._run_unit(unit, bar):
                    self._keep(record)
        finally:
            bar.close()
            for client in self._clients.values():
                client.close()
            self._clients = {}
        return self.records

    # ----------------------------------------------------------- helpers

    def _client(self, route: Route, i: int):
        """Client i of the orchestrator serving `route` (made once)."""
        from orchestrator.client import Client

        if (route, i) not in self._clients:
            self._clients[(route, i)] = Client(self.services.address_of(route),
                                               timeout_s=self.request_timeout_s)
        return self._clients[(route, i)]

    def _connect(self, route: Route, n: int, timeout_s: float = 10.0) -> None:
        """Clients 0..n-1 of `route`, made and their channels connected: a
        wave's clock starts after this, so its first wave does not time the
        making and connecting of clients that the warm-up never used (only
        client 0 is warmed). A channel that does not connect in time is left
        to its first request, which then fails or waits as it would (and the
        others are not waited for: they go to the same server)."""
        import grpc

        for i in range(n):
            channel = getattr(self._client(route, i), "channel", None)
            if channel is None:
                continue
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                return

    def _keep(self, record: dict) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        if (not record["ok"] and record["error_code"] in UNSUPPORTED_CODES
                and not any(r["ok"] for r in self.records if r["config"] == record["config"])):
            self.skipped[record["config"]] = record["error"]
            self.log(f"specd bench: skipping {record['config']}: the orchestrator refused it ({record['error']})")

    def _run_unit(self, unit: Unit, bar) -> list[dict]:
        cfg = unit.config
        cond = self.plan.conditions[unit.condition]
        if cfg.kind == SERVICE:
            self.services.reset_peaks()
            bytes_before = self.services.proxy_bytes()
            if unit.concurrency > 1:
                self._connect(cfg.route, unit.concurrency)  # before the clock: made and connected once
            start = time.perf_counter()
            if unit.concurrency == 1:
                results = [_service_request(self._client(cfg.route, 0), cfg, unit.jobs[0], unit.temperature,
                                            self.plan.max_tokens)]
                bar.update(1)
            else:
                results = self._wave(unit, bar)
            unit_wall = time.perf_counter() - start
            peaks, gpu = self.services.peaks_mb(), self.services.gpu_mb()
            bytes_after = self.services.proxy_bytes()
            proxy_bytes = None if bytes_before is None else bytes_after - bytes_before
        else:
            prompt = unit.jobs[0]
            start = time.perf_counter()
            result = self.hf.generate(list(prompt.token_ids), max_tokens=self.plan.max_tokens,
                                      temperature=unit.temperature, seed=prompt.seed, kind=cfg.kind)
            unit_wall = time.perf_counter() - start
            bar.update(1)
            peaks, gpu, proxy_bytes = result.pop("peak_mb"), result.pop("gpu_mb"), None
            results = [dict(result, ok=True, error=None, error_code=None, stats=None, prompt=prompt)]
        records = []
        for i, res in enumerate(results):
            prompt = res.pop("prompt", None) or unit.jobs[i]
            n = len(res["token_ids"])
            records.append({
                "unit": unit.id, "config": cfg.name, "kind": cfg.kind, "policy": cfg.policy or None, "k": cfg.k,
                "pipeline": cfg.pipeline, "draft_vocab": cfg.draft_vocab if cfg.speculative else None,
                "batching": cfg.batching if cfg.kind == SERVICE else None,
                "gate": cfg.gate if cfg.speculative else None, "temperature": unit.temperature, "concurrency": unit.concurrency,
                **cond.to_json(), "repeat": unit.repeat, "prompt_index": prompt.index, "prompt_kind": prompt.kind,
                "prompt_tokens": len(prompt.token_ids), "seed": prompt.seed, "max_tokens": self.plan.max_tokens,
                "ok": res["ok"], "error": res["error"], "error_code": res["error_code"],
                "completion_tokens": n, "wall_s": res["wall_s"], "ttft_s": res["ttft_s"],
                "tokens_per_s": n / res["wall_s"] if res["wall_s"] > 0 else None,
                "finish_reason": res["finish_reason"], "token_ids": res["token_ids"],
                "arrivals": [[round(t, 6), c] for t, c in res["arrivals"]], "stats": res["stats"],
                "unit_requests": len(results), "unit_wall_s": unit_wall, "unit_proxy_bytes": proxy_bytes,
                "peak_mb": peaks, "gpu_mb": gpu, "identical_to_target_only": None,
            })
        return records

    def _wave(self, unit: Unit, bar) -> list[dict]:
        """The unit's jobs through `concurrency` client threads pulling from one queue."""
        jobs: queue.Queue = queue.Queue()
        for p in unit.jobs:
            jobs.put(p)
        results: list[dict] = []

        def worker(i: int) -> None:
            client = self._client(unit.config.route, i)
            while True:
                try:
                    prompt = jobs.get_nowait()
                except queue.Empty:
                    return
                res = _service_request(client, unit.config, prompt, unit.temperature, self.plan.max_tokens)
                res["prompt"] = prompt
                with self._lock:
                    results.append(res)
                    bar.update(1)

        with concurrent.futures.ThreadPoolExecutor(unit.concurrency) as pool:
            for f in [pool.submit(worker, i) for i in range(unit.concurrency)]:
                f.result()
        return results


def mark_identity(records: list[dict]) -> None:
    """Fill identical_to_target_only: each record's tokens against the
    target-only (service) tokens for the same prompt, temperature, repeat and
    network condition at concurrency 1. None where there is no reference."""
    reference = {}
    for r in records:
        if r["config"] == TARGET_ONLY and r["concurrency"] == 1 and r["ok"]:
            reference[(r["network"], r["repeat"], r["temperature"], r["prompt_index"])] = r["token_ids"]
    for r in records:
        key = (r["network"], r["repeat"], r["temperature"], r["prompt_index"])
        if r["ok"] and key in reference and not (r["config"] == TARGET_ONLY and r["concurrency"] == 1):
            r["identical_to_target_only"] = r["token_ids"] == reference[key]
        elif r["ok"] and key in reference:
            r["identical_to_target_only"] = True
