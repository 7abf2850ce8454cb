"""`specd serve orchestrator`: connect to the services, check they fit
together, load the tokenizer, serve Generate."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from orchestrator.batcher import VerifyBatcher
from orchestrator.speculation_gate import GateSettings, SpeculationGate
from orchestrator.config import OrchestratorConfig
from orchestrator.downstream import DraftClient, TargetClient
from orchestrator.gamma_policy import make_policy
from orchestrator.openai_api.config import HttpConfig
from orchestrator.recovery import RecoverySettings, report_health
from orchestrator.replica_checks import admission, check_replicas, replica_infos, usable_size_of
from orchestrator.replicas import Replica, ReplicaPool, split_address
from orchestrator.security import Dialer, downstream_dialer
from orchestrator.servicer import Backends, OrchestratorServicer
from orchestrator.speculation import LoopSettings
from orchestrator.tokenizer import end_ids, load_tokenizer
from specdec.errors import FailedPrecondition, InvalidArgument, Unavailable
from specdec.limits import check_min_confidence
from specdec.rpc.auth import api_key_guard
from specdec.rpc.serving import RunningServer, ServerConfig, start_server
from specdec.security.api_keys import ApiKeyChecker, load_api_keys
from specdec.security.tls import TlsConfig, refuse_plaintext
from specdec.telemetry import NOOP, Telemetry
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "specdec.v1.OrchestratorService"


@dataclass
class Orchestrator:
    running: RunningServer
    backends: Backends
    health_task: asyncio.Task | None = None  # readiness NOT_SERVING while no target replica is reachable
    http: object | None = None  # the OpenAI-compatible front door (openai_api.server.HttpFrontDoor)

    @property
    def port(self) -> int:
        return self.running.port

    async def drain(self, grace_s: float) -> None:
        """Both front doors at once: refuse new requests, give those in flight grace_s."""
        await asyncio.gather(self.running.drain(grace_s), *([self.http.stop(grace_s)] if self.http else []))

    async def wait(self) -> None:
        await self.running.wait()

    async def stop(self, grace_s: float = 0.0) -> None:
        if self.health_task is not None:
            self.health_task.cancel()
        await self.drain(grace_s)
        await self.close_channels()

    async def close_channels(self) -> None:
        await self.backends.targets.close()
        if self.backends.drafts is not None:
            await self.backends.drafts.close()


async def _wait_for_info(client, timeout_s: float):
    """GetModelInfo, retried until the service answers or timeout_s passes
    (the model services may still be loading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.fetch_info(timeout=min(10.0, max(0.1, deadline - time.monotonic())))
        except grpc.aio.AioRpcError as exc:
            if time.monotonic() >= deadline:
                raise Unavailable(f"the {client.name} service did not answer: {exc.code().name}: {exc.details()}") from None
            await asyncio.sleep(0.5)


def _use_lane(cfg: OrchestratorConfig, dial: Dialer, client, service_address: str, address: str) -> None:
    """The replica's lane for its round calls, when it has one and --lanes is on."""
    host = split_address(address)[0]
    if cfg.lanes and client.use_lane(host, dial.lane(service_address, address)):
        log.info("the %s replica at %s: round calls on its lane, port %d", client.name, address,
                 client.info.lane_port)


def check_defaults(cfg: OrchestratorConfig, max_draft_tokens: int) -> None:
    """The default policy must fit the limit in force (the smallest of
    --max-draft-tokens and the services' own): refuse to start otherwise,
    rather than fail every request that takes the defaults."""
    try:
        make_policy(cfg.policy, cfg.num_draft_tokens, cfg.min_draft_tokens, max_draft_tokens, max_draft_tokens)
    except ValueError as exc:
        raise FailedPrecondition(f"the default policy does not fit max_draft_tokens = {max_draft_tokens} (the "
                                 f"smallest of --max-draft-tokens and the services' limits): {exc}") from None
    try:
        check_min_confidence(cfg.draft_min_confidence, "--draft-min-confidence")
    except InvalidArgument as exc:
        raise FailedPrecondition(str(exc)) from None


def gate_settings(cfg: OrchestratorConfig) -> GateSettings:
    """The speculation gate's settings from the flags; refuses values it cannot run with."""
    if cfg.gate_min_streams < 1:
        raise FailedPrecondition(f"--gate-min-streams must be >= 1, not {cfg.gate_min_streams}")
    if not 0 < cfg.gate_probe_cost <= 1:
        raise FailedPrecondition(f"--gate-probe-cost must be in (0, 1], not {cfg.gate_probe_cost}")
    if not cfg.gate_epoch_ms >= 0:
        raise FailedPrecondition(f"--gate-epoch-ms must be >= 0, not {cfg.gate_epoch_ms}")
    return GateSettings(enabled=cfg.speculation_gate, min_streams=cfg.gate_min_streams,
                        min_epoch_s=cfg.gate_epoch_ms / 1000, probe_cost=cfg.gate_probe_cost)


async def _connected(client, cfg: OrchestratorConfig, dial: Dialer, service_address: str, address: str):
    """`client` once its replica answered GetModelInfo (it may still be
    loading its model: up to connect_timeout_s), on its lane. A replica that
    never answers, or whose wait is cancelled (its address left the name, the
    orchestrator stops), has its channel closed here: nothing else holds it."""
    try:
        await _wait_for_info(client, cfg.connect_timeout_s)
        _use_lane(cfg, dial, client, service_address, address)
    except BaseException:
        await client.aclose()
        raise
    return client


async def _start_pools(pools: list[ReplicaPool], timeout_s: float) -> None:
    """Start the pools at once (draft and target load their models at the
    same time); the first that fails stops the others."""
    tasks = [asyncio.ensure_future(pool.start(timeout_s)) for pool in pools]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _backends(cfg: OrchestratorConfig, targets: ReplicaPool, drafts: ReplicaPool | None, tokenizer) -> Backends:
    """Check the replicas connected so far, take the limits from all of them
    (the smallest), and have the pools check those that join later. Nothing
    awaits here, so every replica is either checked now or by `admission`."""
    check_replicas(targets, drafts)
    reference = targets.any()
    target_info = reference.client.info
    infos = [info for _, info in replica_infos(targets) + replica_infos(drafts)]
    max_draft_tokens = min([cfg.max_draft_tokens] + [i.max_draft_tokens for i in infos])
    check_defaults(cfg, max_draft_tokens)
    settings = LoopSettings(rpc_timeout_s=cfg.rpc_timeout_s, draft_retry_s=cfg.draft_retry_s,
                            pipeline_call_cost_s=cfg.pipeline_call_cost_ms / 1000,
                            pipeline_always=cfg.pipeline_always,
                            max_context=min(i.max_context for i in infos),
                            max_draft_tokens=max_draft_tokens)
    targets.admit = admission(target_info, settings, draft=False, reference_address=reference.address)
    if drafts is not None:
        drafts.admit = admission(target_info, settings, draft=True, reference_address=reference.address)
    return Backends(targets=targets, drafts=drafts, tokenizer=tokenizer, settings=settings,
                    eos_ids=end_ids(target_info.eos_token_ids, tokenizer), vocab_size=usable_size_of(target_info),
                    recovery=RecoverySettings(window_s=cfg.target_recovery_s))


async def build_backends(cfg: OrchestratorConfig, tokenizer=None, telemetry: Telemetry = NOOP,
                         dial: Dialer | None = None) -> Backends:
    """Resolve and connect every replica of both services (channels from
    `dial`: plaintext by default), check that they fit together, and load the
    tokenizer. Starts once a replica of each service answered (`ReplicaPool.
    start`); the others join when they answer, and the pools re-resolve their
    names from then on. Everything is closed if start-up fails."""
    dial = dial or Dialer()
    gate = gate_settings(cfg)
    # The clients put the trace context on each call themselves (no interceptors: they cost a call's worth).

    async def make_target(address: str) -> Replica:
        client = await _connected(TargetClient(dial.channel(cfg.target, address), call_streams=cfg.call_streams),
                                  cfg, dial, cfg.target, address)
        batcher = VerifyBatcher(client, max_batch=min(cfg.max_batch, client.info.max_verify_batch or cfg.max_batch),
                                window_s=cfg.batch_window_ms / 1000, rpc_timeout_s=cfg.rpc_timeout_s,
                                enabled=cfg.batching, telemetry=telemetry,
                                max_in_flight=cfg.max_batches_in_flight, gate=SpeculationGate(gate))
        return Replica(address, client, batcher)

    async def make_draft(address: str) -> Replica:
        client = await _connected(DraftClient(dial.channel(cfg.draft, address), call_streams=cfg.call_streams),
                                  cfg, dial, cfg.draft, address)
        return Replica(address, client)

    async def close(replica: Replica) -> None:
        await replica.client.aclose()

    targets = ReplicaPool(cfg.target, make_target, close, refresh_s=cfg.resolve_interval_s)
    drafts = ReplicaPool(cfg.draft, make_draft, close, refresh_s=cfg.resolve_interval_s) if cfg.draft else None
    pools = [pool for pool in (targets, drafts) if pool is not None]
    try:
        await _start_pools(pools, cfg.connect_timeout_s)
        if tokenizer is None:
            tokenizer = await asyncio.get_running_loop().run_in_executor(
                None, load_tokenizer, cfg.tokenizer or targets.any().client.info.model_name)
        backends = _backends(cfg, targets, drafts, tokenizer)
    except BaseException:
        await asyncio.gather(*(pool.close() for pool in pools))
        raise
    for pool in pools:
        pool.start_refreshing()
    return backends


async def start_orchestrator(server_cfg: ServerConfig, cfg: OrchestratorConfig, tokenizer=None,
                             interceptors=(), telemetry: Telemetry = NOOP,
                             http: HttpConfig | None = None, tls: TlsConfig | None = None) -> Orchestrator:
    """Bind (NOT_SERVING; the HTTP port too when `http` enables it), connect
    to the services, then SERVING. `tls` secures both front doors (plaintext
    by default, which only loopback or `tls.insecure` allows); the services
    are dialed as cfg.downstream_* say; API keys, when configured, are
    required at both front doors (docs/security.md)."""
    # Every setting is checked before anything binds.
    if http is not None:
        http.validate()
    tls = (tls or TlsConfig()).validate(server_cfg.host, "orchestrator", require_client_certs=False)
    if http is not None and http.enabled and http.http_host and not tls.enabled:
        refuse_plaintext(http.http_host, "the orchestrator's HTTP port", tls.insecure)
    dial = downstream_dialer(cfg, tls.insecure)
    api_keys = ApiKeyChecker(load_api_keys(cfg.api_key_file))
    if api_keys.required:
        interceptors = (api_key_guard(api_keys), *interceptors)
    holder: dict[str, OrchestratorServicer] = {}

    class _Pending(orchestrator_pb2_grpc.OrchestratorServiceServicer):
        async def Generate(self, request, context):
            servicer = holder.get("s")
            if servicer is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the orchestrator is still connecting to its services")
            async for item in servicer.Generate(request, context):
                yield item

    running = await start_server(
        server_cfg, lambda server: orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(_Pending(), server),
        [SERVICE_NAME], interceptors=interceptors, credentials=tls.server_credentials())
    front = None
    try:
        if http is not None and http.enabled:
            from orchestrator.openai_api.server import start_http

            front = await start_http(http, server_cfg.host, telemetry, tls=tls, api_keys=api_keys)
        backends = await build_backends(cfg, tokenizer, telemetry, dial)
    except BaseException:
        await asyncio.gather(running.drain(0), *([front.stop(0)] if front else []))
        raise
    holder["s"] = OrchestratorServicer(cfg, backends, telemetry)
    if front is not None:
        front.set_ready(holder["s"], backends.targets.any().client.info.model_name, backends.settings.max_context)
    await running.set_serving()

    async def set_serving(serving: bool) -> None:
        """Readiness follows the targets at both front doors: the gRPC
        service's status (not "", which liveness probes read) and HTTP /health."""
        await running.set_readiness(serving)
        if front is not None:
            front.state.targets_serving = serving

    health = asyncio.ensure_future(report_health(backends.targets, set_serving, cfg.health_interval_s,
                                                 backends.drafts))
    return Orchestrator(running=running, backends=backends, health_task=health, http=front)
