"""The three services as child processes, latency proxies between them, and
memory probes.

Each role runs as `python -m specdec.cli.main serve ROLE --port 0 ...`, as
`specd up` runs them; the port the server picked is read from its log line
"listening on HOST:PORT", then `wait_serving` waits until it reports
SERVING. Logs go into the results folder. `ServiceSet.stop()` always runs
(the bench calls it from a finally): SIGTERM, then SIGKILL after a grace.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from specdec.processes import stop_processes, wait_serving

_LISTENING = re.compile(r"listening on [^\s]*:(\d+)")


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
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


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
class Service:
    role: str
    proc: subprocess.Popen
    log_path: Path
    command: list[str]
    port: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def describe(self) -> dict:
        return {"role": self.role, "pid": self.pid, "port": self.port, "log": str(self.log_path),
                "command": self.command}


def spawn_role(role: str, args: list[str], log_dir: Path, env: dict, name: str = "") -> Service:
    """Start `specd serve ROLE --port 0 ARGS`, its output in LOG_DIR/NAME.log
    (NAME defaults to the role; replicas of one role need their own)."""
    name = name or role
    command = [sys.executable, "-m", "specdec.cli.main", "serve", role, "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", *args]
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "w")
    try:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor
    return Service(name, proc, log_path, command)


def read_port(service: Service, timeout_s: float) -> int:
    """The port a service started by `spawn_role` bound, from its log line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            match = _LISTENING.search(service.log_path.read_text(errors="replace"))
        except OSError:
            match = None
        if match:
            return int(match.group(1))
        if service.proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = _log_tail(service.log_path)
    raise RuntimeError(f"the {service.role} service did not start (exit code {service.proc.poll()}); "
                       f"its log {service.log_path} ends with:\n{tail}")


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


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
    draft_vocab: int = 0  # the draft's output head over its N most frequent ids (0: all)


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
        env = dict(os.environ if env is None else env)
        env.pop("OTEL_SERVICE_NAME", None)  # each role names itself
        self.env = env
        self.services: dict[str, Service] = {}
        self.proxies: dict[str, object] = {}

    # ---------------------------------------------------------- lifecycle

    def start_models(self) -> None:
        """Spawn target and draft (they load in parallel); returns once both
        have bound their ports. Call wait_models() before using them."""
        o = self.opts
        common = ["--dtype", o.dtype, "--threads", str(o.threads), "--max-context", str(o.max_context)]
        self.services["target"] = spawn_role("target", ["--model", o.target, "--device", o.target_device, *common],
                                         self.log_dir, self.env)
        head = ["--draft-vocab", str(o.draft_vocab)] if o.draft_vocab else []
        self.services["draft"] = spawn_role("draft", ["--model", o.draft, "--device", o.draft_device, *common, *head],
                                        self.log_dir, self.env)
        for role in ("target", "draft"):
            self.services[role].port = read_port(self.services[role], 120.0)

    def wait_models(self) -> None:
        procs = [s.proc for s in self.services.values()]
        for role in ("target", "draft"):
            try:
                wait_serving(self.services[role].port, procs, self.opts.startup_timeout_s)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n{self._tails()}") from None

    def start_proxies(self, delay_ms: dict[str, float], jitter_ms: float = 0.0) -> None:
        """A LatencyProxy in front of each model service (one-way delay per role);
        imported only when network conditions are asked for."""
        from specdec.latency_proxy import LatencyProxy

        for role in ("target", "draft"):
            proxy = LatencyProxy(upstream=self.services[role].address, delay_ms=delay_ms[role],
                                 jitter_ms=jitter_ms, bandwidth_mbps=0.0)
            proxy.start()
            self.proxies[role] = proxy

    def set_delays(self, delay_ms: dict[str, float]) -> None:
        for role, proxy in self.proxies.items():
            proxy.set_delay(delay_ms[role])

    def proxy_bytes(self) -> int | None:
        """Bytes the proxies have forwarded so far, both directions, both services."""
        if not self.proxies:
            return None
        return int(sum(getattr(p, "bytes_up", 0) + getattr(p, "bytes_down", 0) for p in self.proxies.values()))

    def start_orchestrator(self, extra: list[str] | tuple[str, ...] = ()) -> None:
        """extra: more `specd serve orchestrator` flags."""

        def upstream(role: str) -> str:
            proxy = self.proxies.get(role)
            return proxy.address if proxy is not None else self.services[role].address

        args = ["--draft", upstream("draft"), "--target", upstream("target"),
                "--rpc-timeout-s", "600", "--max-tokens-limit", "100000"]
        if self.opts.tokenizer:
            args += ["--tokenizer", self.opts.tokenizer]
        args += list(extra)
        orch = spawn_role("orchestrator", args, self.log_dir, self.env)
        self.services["orchestrator"] = orch
        orch.port = read_port(orch, 120.0)
        try:
            wait_serving(orch.port, [s.proc for s in self.services.values()], self.opts.startup_timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{self._tails()}") from None

    @property
    def orchestrator_address(self) -> str:
        return self.services["orchestrator"].address

    def stop(self) -> None:
        """Stop every process this set started (orchestrator first) and the proxies."""
        stop_processes([self.services[r].proc for r in ("orchestrator", "draft", "target") if r in self.services])
        for proxy in self.proxies.values():
            try:
                proxy.stop()
            except Exception:  # noqa: BLE001 - stopping must not mask the bench's own error
                pass
        self.proxies = {}

    def _tails(self) -> str:
        return "\n".join(f"--- {s.role} log ({s.log_path}):\n{_log_tail(s.log_path)}" for s in self.services.values())

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
