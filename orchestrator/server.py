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
from orchestrator.replicas import Replica, ReplicaPool, split_address
from orchestrator.security import Dialer, downstream_dialer
from orchestrator.servicer import Backends, OrchestratorServicer
from orchestrator.speculation import LoopSettings
from orchestrator.tokenizer import load_tokenizer
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


def usable_size_of(info) -> int:
    """The usable size a ModelInfo or EngineInfo announces
    (`specdec.engine.vocab.usable_size`); 0 in `usable_vocab_size` (a service
    older than the field, or the n-gram drafter) means all `vocab_size` ids."""
    return int(info.usable_vocab_size or info.vocab_size)


def check_compatible(draft_info, target_info) -> None:
    """The draft's token ids must mean the same as the target's (`check_same_ids`)."""
    if draft_info.backend == "ngram":
        if draft_info.vocab_size != target_info.vocab_size:
            raise FailedPrecondition(f"the ngram drafter's vocabulary ({draft_info.vocab_size}) differs from the target's ({target_info.vocab_size})")
        return
    check_same_ids(draft_info, target_info, ("draft", "target"))


def check_same_ids(a, b, roles: tuple[str, str]) -> None:
    """Two models' token ids must mean the same: a draft and its target, or
    two replicas of one service (a request moves between target replicas).

    Two models with tokenizers must share the tokenizer; their embedding rows
    may differ (Qwen2.5-0.5B pads to 151936 rows, the 7B to 152064), since each
    engine emits only the ids its tokenizer knows. Without a tokenizer, a model
    may name its family's ids (a synthetic Qwen2.5: `untokenized-qwen2.5-151665`),
    and two that name the same pair like tokenized ones; otherwise the ids are
    all there is, so the vocabulary sizes must be equal. `roles` names the
    two in the messages ("draft", "target").
    """
    names = f"{roles[0]} {a.model_name!r} and {roles[1]} {b.model_name!r}"
    fingerprints = (a.tokenizer_fingerprint, b.tokenizer_fingerprint)
    if all(fp and not fp.startswith("untokenized") for fp in fingerprints):
        if fingerprints[0] != fingerprints[1]:
            raise FailedPrecondition(f"{names} have different tokenizers: the two models must share a tokenizer")
    elif a.vocab_size != b.vocab_size and not (fingerprints[0] and len(set(fingerprints)) == 1):
        raise FailedPrecondition(
            f"{names}: {roles[0]} vocabulary size {a.vocab_size} != {roles[1]}'s {b.vocab_size}: "
            "the two models must share a tokenizer")
    if usable_size_of(a) != usable_size_of(b):
        raise FailedPrecondition(
            f"{names} read and emit different token ids ([0, {usable_size_of(a)}) and "
            f"[0, {usable_size_of(b)})): give both the same tokenizer, with an embedding row for each token"
        )


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


def _infos(pool: ReplicaPool | None) -> list[tuple[str, object]]:
    return [(r.address, r.client.info) for r in pool.replicas.values()] if pool else []


def check_replica_ids(info, reference, draft: bool, roles: tuple[str, str]) -> None:
    """A replica against the reference target: a draft must draft for it
    (`check_compatible`: its token ids, whatever its weights, since
    rejection sampling is exact for any draft); a target replica must read
    and write the same ids (`check_same_ids`) and be the same model
    (`check_same_model`), since a request moves between target replicas.
    `roles` names the two in a message. Start-up (`check_replicas`) and a
    replica joining later (`admission`) both check here."""
    if draft:
        check_compatible(info, reference)
    else:
        check_same_ids(info, reference, roles)
        check_same_model(info, reference, roles)


def check_same_model(a, b, roles: tuple[str, str]) -> None:
    """Two target replicas must compute one distribution: the same weights
    (`weights_fingerprint`, specdec/models/fingerprint.py), at the same
    dtype, in the same form (`weights`: int8 or not), ending generations on
    the same EOS ids. A request moves between target replicas when one
    fails, and its tokens must all come from one model: the output
    distribution is the target model's own, exactly. Where either replica
    reports no fingerprint (a service older than the field), only the
    model names can be compared, with a warning."""
    def differ(what: str, mine, theirs) -> FailedPrecondition:
        return FailedPrecondition(
            f"{roles[0]} ({a.model_name!r}) and {roles[1]} ({b.model_name!r}) are not the same model: "
            f"{what} {mine} != {theirs}. Every target replica must serve the same model (a request moves "
            "between them): give them all one checkpoint and settings, and to change the target model, "
            "roll every replica and restart the orchestrator")

    # The plainest difference first: other weights at another dtype differ in both.
    if a.dtype != b.dtype:
        raise differ("dtype", a.dtype, b.dtype)
    if a.weights != b.weights:
        raise differ("weights", repr(a.weights or "at dtype"), repr(b.weights or "at dtype"))
    if set(a.eos_token_ids) != set(b.eos_token_ids):
        raise differ("EOS token ids", sorted(set(a.eos_token_ids)), sorted(set(b.eos_token_ids)))
    if a.weights_fingerprint and b.weights_fingerprint:
        if a.weights_fingerprint != b.weights_fingerprint:
            raise differ("weights fingerprint", _short(a.weights_fingerprint), _short(b.weights_fingerprint))
        return
    if a.model_name != b.model_name:
        raise differ("model name", repr(a.model_name), repr(b.model_name))
    log.warning("%s and %s: %s reports no weights fingerprint (a service older than the field), so only "
                "their model names (%r) could be compared, not their weights", roles[0], roles[1],
                " and ".join(r for r, i in zip(roles, (a, b)) if not i.weights_fingerprint), a.model_name)


def _short(fingerprint: str) -> str:
    return fingerprint if len(fingerprint) <= 19 else fingerprint[:19] + "..."


def check_replicas(targets: ReplicaPool, drafts: ReplicaPool | None) -> None:
    """Every replica connected at start-up must fit the first target
    (`check_replica_ids`): target replicas read and write its token ids and
    are its model, and any draft replica drafts for any target replica."""
    first = targets.any()
    reference = first.client.info
    for address, info in _infos(targets):
        if address != first.address:
            check_replica_ids(info, reference, False, (f"target replica {address}", f"target replica {first.address}"))
    for _, info in _infos(drafts):
        check_replica_ids(info, reference, True, ("draft", "target"))


def admission(reference, settings: LoopSettings, draft: bool, reference_address: str = ""):
    """The check a replica that joins after start-up must pass (the pool
    refuses and closes it otherwise): what start-up checked
    (`check_replica_ids`; `reference_address` names the reference target in
    a message), and limits no smaller than those the orchestrator already
    uses (it accepts requests by them, and a request must fit on any
    replica)."""
    def admit(replica: Replica) -> None:
        info = replica.client.info
        check_replica_ids(info, reference, draft, (
            f"the new target replica {replica.address}",
            f"target replica {reference_address}" if reference_address else "the target"))
        if info.max_context < settings.max_context or info.max_draft_tokens < settings.max_draft_tokens:
            raise FailedPrecondition(
                f"its limits (max_context {info.max_context}, max_draft_tokens {info.max_draft_tokens}) are below "
                f"those the orchestrator uses ({settings.max_context}, {settings.max_draft_tokens}); "
                "restart the orchestrator to serve with smaller limits")
    return admit


def _backends(cfg: OrchestratorConfig, targets: ReplicaPool, drafts: ReplicaPool | None, tokenizer) -> Backends:
    """Check the replicas connected so far, take the limits from all of them
    (the smallest), and have the pools check those that join later. Nothing
    awaits here, so every replica is either checked now or by `admission`."""
    check_replicas(targets, drafts)
    reference = targets.any()
    target_info = reference.client.info
    infos = [info for _, info in _infos(targets) + _infos(drafts)]
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
    eos = set(target_info.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return Backends(targets=targets, drafts=drafts, tokenizer=tokenizer, settings=settings,
                    eos_ids=frozenset(eos), vocab_size=usable_size_of(target_info),
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
