"""`specd serve orchestrator`: connect to the services, check they fit
together, load the tokenizer, serve Generate."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from orchestrator.batcher import VerifyBatcher
from orchestrator.config import OrchestratorConfig
from orchestrator.downstream import DraftClient, TargetClient, channel_to
from orchestrator.servicer import Backends, OrchestratorServicer
from orchestrator.speculation import LoopSettings
from specdec.errors import FailedPrecondition, Unavailable
from specdec.serving import RunningServer, ServerConfig, start_server
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "specdec.v1.OrchestratorService"


@dataclass
class Orchestrator:
    running: RunningServer
    backends: Backends
    channels: list[grpc.aio.Channel]

    @property
    def port(self) -> int:
        return self.running.port

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.running.drain(grace_s)
        for channel in self.channels:
            await channel.close()


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


def check_compatible(draft_info, target_info) -> None:
    """The draft's token ids must mean the same as the target's."""
    if draft_info.backend == "ngram":
        if draft_info.vocab_size != target_info.vocab_size:
            raise FailedPrecondition(f"the ngram drafter's vocabulary ({draft_info.vocab_size}) differs from the target's ({target_info.vocab_size})")
        return
    if draft_info.vocab_size != target_info.vocab_size:
        raise FailedPrecondition(
            f"draft vocabulary size {draft_info.vocab_size} != target's {target_info.vocab_size}: "
            "the two models must share a tokenizer"
        )
    fingerprints = (draft_info.tokenizer_fingerprint, target_info.tokenizer_fingerprint)
    if all(fp and not fp.startswith("untokenized") for fp in fingerprints) and fingerprints[0] != fingerprints[1]:
        raise FailedPrecondition("draft and target tokenizers differ: the two models must share a tokenizer")


def load_tokenizer(name: str):
    """A tokenizer from a catalog name or directory; None when there is none."""
    if not name:
        return None
    from transformers import AutoTokenizer

    from specdec.engine.loading import locate

    try:
        where, gguf_file = locate(name)
        return AutoTokenizer.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError, LookupError) as exc:
        log.warning("no tokenizer from %r (%s): only prompt_token_ids requests will work", name, exc)
        return None


async def build_backends(cfg: OrchestratorConfig, tokenizer=None) -> tuple[Backends, list[grpc.aio.Channel]]:
    target_channel = channel_to(cfg.target)
    target = TargetClient(target_channel)
    target_info = await _wait_for_info(target, cfg.connect_timeout_s)
    channels = [target_channel]
    draft = None
    if cfg.draft:
        draft_channel = channel_to(cfg.draft)
        channels.append(draft_channel)
        draft = DraftClient(draft_channel)
        draft_info = await _wait_for_info(draft, cfg.connect_timeout_s)
        check_compatible(draft_info, target_info)
    if tokenizer is None:
        tokenizer = await asyncio.get_running_loop().run_in_executor(
            None, load_tokenizer, cfg.tokenizer or target_info.model_name)
    eos = set(target_info.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    limits = [target_info.max_draft_tokens] + ([draft.info.max_draft_tokens] if draft else [])
    contexts = [target_info.max_context] + ([draft.info.max_context] if draft else [])
    settings = LoopSettings(rpc_timeout_s=cfg.rpc_timeout_s, draft_retry_s=cfg.draft_retry_s,
                            max_context=min(contexts), max_draft_tokens=min(limits))
    batcher = VerifyBatcher(target, max_batch=min(cfg.max_batch, 64), window_s=cfg.batch_window_ms / 1000,
                            rpc_timeout_s=cfg.rpc_timeout_s, enabled=cfg.batching)
    backends = Backends(target=target, draft=draft, batcher=batcher, tokenizer=tokenizer, settings=settings,
                        eos_ids=frozenset(eos), vocab_size=target_info.vocab_size)
    return backends, channels


async def start_orchestrator(server_cfg: ServerConfig, cfg: OrchestratorConfig, tokenizer=None,
                             interceptors=()) -> Orchestrator:
    """Bind (NOT_SERVING), connect to the services, then SERVING."""
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
        [SERVICE_NAME], interceptors=interceptors)
    try:
        backends, channels = await build_backends(cfg, tokenizer)
    except BaseException:
        await running.drain(0)
        raise
    holder["s"] = OrchestratorServicer(cfg, backends)
    await running.set_serving()
    return Orchestrator(running=running, backends=backends, channels=channels)
