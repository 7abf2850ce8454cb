"""The roles of a soak run as child processes: one draft, N target replicas
and one orchestrator, each `specd serve ROLE --port 0` (as `specd bench`
starts them: `specdec.processes.spawn_role`), plus what the soak reads from them:
resident memory (/proc/PID/status) and the sessions each model service holds
(GetModelInfo's `sessions`).

    services = SoakServices(RoleOptions(draft=..., target=..., replicas=2), log_dir)
    try:
        services.start()
        ... services.orchestrator_address, services.rss_mb(), services.session_counts()
    finally:
        services.stop()

Names: "draft", "target0", "target1", ..., "orchestrator". The orchestrator
gets every replica as one comma-separated `--target` list.
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specdec.processes import (Service, log_tail, read_ports, role_env, spawn_role, status_mb, stop_services,
                               wait_all_serving)
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc


@dataclass
class RoleOptions:
    draft: str  # the draft model (a directory or catalog name)
    target: str  # the target model, served by every replica
    replicas: int = 1  # target replicas
    threads: int = 1  # CPU threads per model service
    max_context: int = 1024  # tokens per session (each session's KV slot)
    max_sessions: int = 64  # sessions each model service may hold
    orchestrator_flags: tuple[str, ...] = ()  # more `specd serve orchestrator` flags
    startup_timeout_s: float = 300.0
    env: dict = field(default_factory=dict)  # extra environment of every child


def vm_rss_mb(pid: int) -> float | None:
    """Resident memory of a process now (VmRSS), MiB; None once it is gone."""
    return status_mb(pid, "VmRSS")


_KV_STORE = re.compile(r"KV store: \d+ session slots of \d+ tokens, ([\d.]+) MiB")


# glibc's malloc arenas are anonymous mappings of up to 64 MiB: a KV tensor
# no larger cannot be told from them by size.
ARENA_MB = 64.0


def rss_breakdown_mb(pid: int, kv_tensor_mb: float | None) -> dict[str, float | None] | None:
    """Resident memory of a process split by mapping (/proc/PID/smaps):
    `kv_store`: the anonymous mappings large enough to hold one of the KV
    store's two tensors (`kv_tensor_mb` each; torch.empty, so their pages
    become resident as positions are first written); `other`: the rest (heap
    and malloc arenas, libraries, weights). The kernel merges neighbouring
    anonymous mappings, so `kv_store` may include a little memory next to the
    tensors: an upper bound. Without a KV tensor larger than a malloc arena,
    `kv_store` is None and `other` is everything. None once the process is gone."""
    split = kv_tensor_mb is not None and kv_tensor_mb > ARENA_MB
    kv = other = 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            big_anon = False
            for line in f:
                first = line.split(None, 1)[0]
                if not first.endswith(":"):  # a mapping's header: range, perms, offset, dev, inode[, path]
                    fields = line.split()
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    big_anon = split and len(fields) < 6 and (end - start) >= kv_tensor_mb * 0.99 * 2 ** 20
                elif first == "Rss:":
                    rss = int(line.split()[1])
                    if big_anon:
                        kv += rss
                    else:
                        other += rss
    except (OSError, ValueError):
        return None
    return {"kv_store": round(kv / 1024, 1) if split else None, "other": round(other / 1024, 1)}


def kv_tensor_mb(log_text: str) -> float | None:
    """The size of one of the KV store's two tensors (keys, values), from the
    engine's start-up log line; None for a service without one."""
    match = _KV_STORE.search(log_text)
    return float(match.group(1)) / 2 if match else None


class SoakServices:
    """Start, watch, hurt (`signal`) and stop the roles of one soak run."""

    def __init__(self, opts: RoleOptions, log_dir: Path):
        if opts.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {opts.replicas}")
        self.opts = opts
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = role_env(extra=opts.env)
        self.services: dict[str, Service] = {}
        self._kv_mb: dict[str, float | None] = {}  # one KV store tensor's size per model service

    @property
    def target_names(self) -> list[str]:
        return [f"target{i}" for i in range(self.opts.replicas)]

    @property
    def model_names(self) -> list[str]:
        return ["draft", *self.target_names]

    @property
    def orchestrator_address(self) -> str:
        return self.services["orchestrator"].address

    def start(self) -> None:
        o = self.opts
        common = ["--dtype", "float32", "--threads", str(o.threads), "--max-context", str(o.max_context),
                  "--max-sessions", str(o.max_sessions)]
        for name in self.target_names:
            self.services[name] = spawn_role("target", ["--model", o.target, *common], self.log_dir, self.env, name)
        self.services["draft"] = spawn_role("draft", ["--model", o.draft, *common], self.log_dir, self.env)
        models = [self.services[name] for name in self.model_names]
        read_ports(models)
        # The orchestrator starts while the models load (it waits for them,
        # --connect-timeout-s): its own start-up no longer follows theirs.
        targets = ",".join(self.services[n].address for n in self.target_names)
        orch = spawn_role("orchestrator", ["--draft", self.services["draft"].address, "--target", targets,
                                           "--tokenizer", "", *o.orchestrator_flags], self.log_dir, self.env)
        self.services["orchestrator"] = orch
        wait_all_serving(models, list(self.services.values()), o.startup_timeout_s)
        for name in self.model_names:
            self._kv_mb[name] = kv_tensor_mb(self.services[name].log_path.read_text(errors="replace"))
        read_ports([orch])
        wait_all_serving([orch], list(self.services.values()), o.startup_timeout_s)

    def pid(self, name: str) -> int:
        return self.services[name].pid

    def alive(self, name: str) -> bool:
        return self.services[name].proc.poll() is None

    def signal(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one role (a fault); it is not restarted."""
        self.services[name].proc.send_signal(sig)

    def rss_mb(self) -> dict[str, float | None]:
        return {name: vm_rss_mb(s.pid) if self.alive(name) else None for name, s in self.services.items()}

    def rss_breakdown_mb(self) -> dict[str, dict | None]:
        return {name: rss_breakdown_mb(s.pid, self._kv_mb.get(name)) if self.alive(name) else None
                for name, s in self.services.items()}

    def session_counts(self, timeout_s: float = 5.0) -> dict[str, tuple[int, int] | None]:
        """{model service: (sessions open, sessions expired so far)}; None for
        a service that is down or does not answer."""
        found: dict[str, tuple[int, int] | None] = {}
        for name in self.model_names:
            found[name] = None
            if not self.alive(name):
                continue
            stub_class = draft_pb2_grpc.DraftServiceStub if name == "draft" else target_pb2_grpc.TargetServiceStub
            with grpc.insecure_channel(self.services[name].address) as channel:
                try:
                    reply = stub_class(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout_s)
                except grpc.RpcError:
                    continue
            found[name] = (reply.sessions.open, reply.sessions.expired)
        return found

    def log_tails(self, lines: int = 20) -> str:
        out = []
        for s in self.services.values():
            out.append(f"--- {s.role} ({s.log_path}):\n{log_tail(s.log_path, lines)}")
        return "\n".join(out)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every child (orchestrator first): SIGTERM, SIGKILL after grace_s."""
        order = ["orchestrator", *self.model_names]
        stop_services([self.services[n] for n in order if n in self.services], grace_s)
