"""`specd serve target`: the target service process."""
from __future__ import annotations

import dataclasses

from specdec.engine.config import EngineConfig
from specdec.engine.engine import ModelEngine
from specdec.engine.quantize import refuse_for_target
from specdec.rpc.model_server import ModelService, start_model_service
from specdec.rpc.session_limits import SessionLimits
from specdec.rpc.serving import ServerConfig
from specdec.security.tls import TlsConfig
from specdec.telemetry import NOOP, Telemetry
from specdec.v1 import target_pb2_grpc
from target_service.servicer import TargetServicer
from target_service.verifier import Verifier

SERVICE_NAME = "specdec.v1.TargetService"


def build_verifier(engine_cfg: EngineConfig, limits: SessionLimits, engine: ModelEngine | None = None) -> Verifier:
    refuse_for_target(engine_cfg.quantize if engine is None else engine.quantized)
    if engine is None:
        # auto (a setting shared with the draft, say) never quantizes a target
        engine = ModelEngine.load(dataclasses.replace(engine_cfg, quantize="none"))
        engine.warmup()
    return Verifier(engine, max_draft_tokens=limits.max_draft_tokens, max_verify_batch=limits.max_verify_batch)


async def start_target_service(server_cfg: ServerConfig, limits: SessionLimits, build_backend,
                               interceptors=(), telemetry: Telemetry = NOOP, tls: TlsConfig | None = None) -> ModelService:
    return await start_model_service(
        server_cfg, limits, build_backend,
        make_servicer=lambda worker, lim: TargetServicer(worker, lim, telemetry=telemetry),
        add_to_server=target_pb2_grpc.add_TargetServiceServicer_to_server,
        service_name=SERVICE_NAME,
        interceptors=interceptors,
        tls=tls,
    )
