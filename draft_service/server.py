"""`specd serve draft`: the draft service process."""
from __future__ import annotations

from draft_service.config import DrafterConfig
from draft_service.drafters import ModelDrafter
from draft_service.ngram_drafter import NgramDrafter
from draft_service.servicer import DraftServicer
from specdec.engine.config import EngineConfig
from specdec.engine.engine import ModelEngine
from specdec.rpc.model_server import ModelService, start_model_service
from specdec.rpc.session_limits import SessionLimits
from specdec.rpc.serving import ServerConfig
from specdec.security.tls import TlsConfig
from specdec.telemetry import NOOP, Telemetry
from specdec.v1 import draft_pb2_grpc

SERVICE_NAME = "specdec.v1.DraftService"


def build_drafter(engine_cfg: EngineConfig, drafter_cfg: DrafterConfig, limits: SessionLimits,
                  engine: ModelEngine | None = None):
    """A drafter from settings; `engine` may be passed pre-built (tests)."""
    drafter_cfg.validate()
    if drafter_cfg.drafter == "ngram":
        vocab = engine.vocab_size if engine is not None else _vocab_size(engine_cfg.model)
        return NgramDrafter(vocab, max_context=engine_cfg.max_context, max_sessions=engine_cfg.max_sessions,
                            max_draft_tokens=limits.max_draft_tokens, min_ngram=drafter_cfg.ngram_min,
                            max_ngram=drafter_cfg.ngram_max)
    if engine is None:
        engine = ModelEngine.load(engine_cfg)
        engine.warmup()
    return ModelDrafter(engine, max_draft_tokens=limits.max_draft_tokens, max_q_tokens=drafter_cfg.max_q_tokens,
                        run_ahead=drafter_cfg.run_ahead)


def _vocab_size(model: str) -> int:
    """The vocabulary size of a model, from its config alone (no weights)."""
    from specdec.models import synth

    if synth.is_synth_name(model):
        return synth.get_synth(model).vocab_rows
    from transformers import AutoConfig

    from specdec.models.cache import locate

    where, gguf_file = locate(model)
    config = AutoConfig.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))
    return int(config.vocab_size)


async def start_draft_service(server_cfg: ServerConfig, limits: SessionLimits, build_backend,
                              backend_kind: str = "model", interceptors=(),
                              telemetry: Telemetry = NOOP, tls: TlsConfig | None = None) -> ModelService:
    return await start_model_service(
        server_cfg, limits, build_backend,
        make_servicer=lambda worker, lim: DraftServicer(worker, lim, backend_kind=backend_kind,
                                                        telemetry=telemetry),
        add_to_server=draft_pb2_grpc.add_DraftServiceServicer_to_server,
        service_name=SERVICE_NAME,
        interceptors=interceptors,
        tls=tls,
    )
