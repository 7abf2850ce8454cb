"""The services as child processes, latency proxies between them, and
memory probes: one target, one draft per draft head, one orchestrator per
route (draft head x verify batcher setting).

Each role runs as `python -m specdec.cli.main serve ROLE --port 0 ...`
(`specdec.processes.spawn_role`, as `specd soak` starts them too); the port
the server picked is read from its log line "listening on HOST:PORT", then
`wait_all_serving` waits until it reports SERVING. Logs go into the results folder. `ServiceSet.stop()` always runs
(the bench calls it from a finally): SIGTERM, then SIGKILL after a grace.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

from specdec.bench.configs import Route
from specdec.processes import (Service, log_tail, read_ports, role_env, spawn_role, status_mb, stop_services,
                               wait_all_serving)


# ------------------------------------------------------------------- memory


def reset_peak_rss(pid: int | str) -> bool:
    """Reset a process's peak resident set size (VmHWM) to its current RSS by
    writing 5 to /proc/PID/clear_refs (Linux; allowed for our own children
    and ourselves). False where that is not possible."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb(pid: int | str) -> float | None:
    """VmHWM of a process in MiB (Linux), None if unavailable."""
    return status_mb(pid, "VmHWM")


def gpu_memory_by_pid() -> dict[int, float]:
    """{pid: MiB} of CUDA compute processes from nvidia-smi; {} without it."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[int, float] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            try:
                found[int(parts[0])] = float(parts[1].split()[0])
            except ValueError:
                continue
    return found


# ---------------------------------------------------------------- processes


@dataclasses.dataclass
class ServiceOptions:
    draft: str
    target: str
    draft_device: str = "cpu"
    target_device: str = "cpu"
    dtype: str = "auto"
    threads: int = 0
    tokenizer: str = ""
    startup_timeout_s: float = 900.0
    max_context: int = 4096
    # One draft service per head: its output head over the N most frequent ids (0: all).
    draft_vocabs: tuple[int, ...] = (0,)
    # Every draft service's linear layers as int8 ("int8", CPU), as loaded
    # ("none"), or as the service chooses ("auto", engine/quantize.py).
    draft_quantize: str = "none"
    # Both services' bf16 linears pre-packed for oneDNN: auto, on or off (engine/packed_linear.py).
    packed_linears: str = "auto"


def draft_name(vocab: int, first: bool) -> str:
    """The first draft service is "draft"; others are named by their head."""
    return "draft" if first else f"draft-{'full' if vocab == 0 else f'v{vocab}'}"


def _kind(name: str) -> str:
    """A service's role from its name ("draft-v16384" -> "draft")."""
    return name.split("-", 1)[0]


class ServiceSet:
    """Target, draft and orchestrator processes, optionally with a latency
    proxy in front of each model service.

        services = ServiceSet(opts, log_dir)
        try:
            services.start_models(); ...; services.start_orchestrator(proxied=True)
        finally:
            services.stop()
    """

    def __init__(self, opts: ServiceOptions, log_dir: Path, env: dict | None = None):
        self.opts = opts
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = role_env(env)
        self.services: dict[str, Service] = {}
        self.proxies: dict[str, object] = {}
        self.orchestrators: dict[Route, str] = {}  # route -> service name

    # ---------------------------------------------------------- lifecycle

    def start_models(self) -> None:
        """Spawn target and draft (they load in parallel); returns once both
        have bound their ports. Call wait_models() before using them."""
        o = self.opts
        common = ["--dtype", o.dtype, "--threads", str(o.threads), "--max-context", str(o.max_context),
                  "--packed-linears", o.packed_linears]
        self.services["target"] = spawn_role("target", ["--model", o.target, "--device", o.target_device, *common],
                                         self.log_dir, self.env)
        for i, vocab in enumerate(o.draft_vocabs):
            head = ["--draft-vocab", str(vocab)] if vocab else []
            head += ["--quantize", o.draft_quantize]
            name = draft_name(vocab, i == 0)
            self.services[name] = spawn_role("draft", ["--model", o.draft, "--device", o.draft_device, *common,
                                                       *head], self.log_dir, self.env, name=name)
        read_ports([self.services[role] for role in self._model_roles()])

    def _model_roles(self) -> list[str]:
        return ["target"] + [draft_name(v, i == 0) for i, v in enumerate(self.opts.draft_vocabs)]

    def wait_models(self) -> None:
        wait_all_serving([self.services[role] for role in self._model_roles()], list(self.services.values()),
                         self.opts.startup_timeout_s, self._tails)

    def start_proxies(self, delay_ms: dict[str, float], jitter_ms: float = 0.0) -> None:
        """A LatencyProxy in front of each model service (one-way delay per
        role, "draft" for every draft head); imported only when network
        conditions are asked for."""
        from specdec.latency_proxy import LatencyProxy

        for role in self._model_roles():
            proxy = LatencyProxy(upstream=self.services[role].address, delay_ms=delay_ms[_kind(role)],
                                 jitter_ms=jitter_ms, bandwidth_mbps=0.0)
            proxy.start()
            self.proxies[role] = proxy

    def set_delays(self, delay_ms: dict[str, float]) -> None:
        for role, proxy in self.proxies.items():
            proxy.set_delay(delay_ms[_kind(role)])

    def proxy_bytes(self) -> int | None:
        """Bytes the proxies have forwarded so far, both directions, both services."""
        if not self.proxies:
            return None
        return int(sum(getattr(p, "bytes_up", 0) + getattr(p, "bytes_down", 0) for p in self.proxies.values()))

    def start_orchestrator(self, extra: list[str] | tuple[str, ...] = (), routes: list[Route] | None = None) -> None:
        """One orchestrator per route (the draft head it talks to, its verify
        batcher and speculation gate on or off; default: the first head, both on). The first is named
        "orchestrator". extra: more `specd serve orchestrator` flags."""
        routes = list(routes) if routes else [Route(self.opts.draft_vocabs[0])]
        heads = {v: draft_name(v, i == 0) for i, v in enumerate(self.opts.draft_vocabs)}

        def upstream(role: str) -> str:
            proxy = self.proxies.get(role)
            return proxy.address if proxy is not None else self.services[role].address

        started = []
        for i, route in enumerate(routes):
            if route.draft_vocab not in heads:
                raise ValueError(f"no draft service with head {route.draft_vocab}")
            args = ["--draft", upstream(heads[route.draft_vocab]), "--target", upstream("target"),
                    "--rpc-timeout-s", "600", "--max-tokens-limit", "100000"]
            if self.opts.tokenizer:
                args += ["--tokenizer", self.opts.tokenizer]
            if not route.batching:
                args.append("--no-batching")
            if not route.gate:
                args.append("--no-speculation-gate")
            args += list(extra)
            name = "orchestrator" if i == 0 else f"orchestrator-{route.name}"
            orch = spawn_role("orchestrator", args, self.log_dir, self.env, name=name)
            self.services[name] = orch
            self.orchestrators[route] = name
            started.append(orch)
        for orch in started:
            read_ports([orch])
            wait_all_serving([orch], list(self.services.values()), self.opts.startup_timeout_s, self._tails)

    @property
    def orchestrator_address(self) -> str:
        """The first orchestrator's address."""
        return self.services["orchestrator"].address

    def address_of(self, route: Route) -> str:
        """The address of the orchestrator started for `route`."""
        return self.services[self.orchestrators[route]].address

    def stop(self) -> None:
        """Stop every process this set started (orchestrators first) and the proxies."""
        order = sorted(self.services, key=lambda name: (_kind(name) != "orchestrator", _kind(name) != "draft"))
        stop_services([self.services[name] for name in order])
        for proxy in self.proxies.values():
            try:
                proxy.stop()
            except Exception:  # noqa: BLE001 - stopping must not mask the bench's own error
                pass
        self.proxies = {}

    def _tails(self) -> str:
        return "\n".join(f"--- {s.role} log ({s.log_path}):\n{log_tail(s.log_path)}" for s in self.services.values())

    # ------------------------------------------------------------- memory

    def pids(self) -> dict[str, int]:
        return {role: s.pid for role, s in self.services.items()}

    def reset_peaks(self) -> None:
        for s in self.services.values():
            reset_peak_rss(s.pid)

    def peaks_mb(self) -> dict[str, float | None]:
        return {role: peak_rss_mb(s.pid) for role, s in self.services.items()}

    def gpu_mb(self) -> dict[str, float] | None:
        by_pid = gpu_memory_by_pid()
        if not by_pid:
            return None
        return {role: by_pid[s.pid] for role, s in self.services.items() if s.pid in by_pid}

    def describe(self) -> list[dict]:
        return [s.describe() for s in self.services.values()]
