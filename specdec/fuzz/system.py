"""The system under fuzz: tiny random models behind real servers, in-process.

A byte-level BPE tokenizer of 300 tokens is trained here (nothing is
downloaded) and both models get 320 embedding rows, so ids 300..319 are the
padded-vocabulary ids a real pair has (Qwen2.5: 151665 tokens, 151936 rows):
they must be refused as input and never emitted. The models are peaked
(weights drawn with a large initializer range), so greedy argmax has clear
margins and a witness session's output does not depend on what its forward
passes were batched with. There is no EOS: generations run to max_tokens.

Every server binds 127.0.0.1:0 on a background event loop and is stopped by
`close()`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specdec.eventloop import BackgroundLoop

USABLE_VOCAB = 300  # tokens of the tokenizer
ROWS = 320  # embedding rows: ids USABLE_VOCAB..ROWS-1 are padding
MAX_CONTEXT = 256
MAX_SESSIONS = 256
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
_CORPUS = ["the quick brown fox jumps over the lazy dog.", "hello world, hello again! naive cafe",
           "def f(x): return x + 1", "héllo wörld ☃ 日本語 🎉"]


def tokenizer():
    """A byte-level BPE of USABLE_VOCAB tokens with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=USABLE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model(seed: int):
    """A 2-layer Llama of ROWS rows, peaked, without EOS."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    built = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    built.generation_config.eos_token_id = None
    return built


def engine(seed: int, tok):
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine

    cfg = EngineConfig(dtype="float32", max_context=MAX_CONTEXT, max_sessions=MAX_SESSIONS,
                       max_kv_bytes=64 << 20, prefill_chunk=128)
    return ModelEngine(model(seed), cfg, tokenizer=tok, name=f"fuzz-tiny-{seed}")


@dataclass
class FuzzSystem:
    """Running servers and their addresses; `close()` stops them all."""

    target_port: int = 0
    draft_port: int = 0
    ngram_port: int = 0  # a draft service over the prompt-lookup drafter
    model_drafter: object = None  # the draft service's ModelDrafter
    orchestrator_port: int = 0
    http_port: int = 0
    tokenizer: object = None
    max_draft_tokens: int = 0
    usage: dict = field(default_factory=dict)  # role -> () -> (open sessions, KV bytes)
    _stops: list = field(default_factory=list)
    _loop: BackgroundLoop | None = None

    def open_sessions(self) -> dict[str, int]:
        return {role: usage()[0] for role, usage in self.usage.items()}

    def close(self) -> None:
        for stop in reversed(self._stops):
            try:
                self._loop.run(stop())
            except Exception:  # noqa: BLE001 - stop the rest anyway
                pass
        self._stops.clear()
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def __enter__(self) -> "FuzzSystem":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start(roles: tuple[str, ...] = ("target", "draft", "orchestrator"), http: bool = False,
          draft_run_ahead: str = "auto") -> FuzzSystem:
    """Start the roles asked for (an orchestrator needs both services; "ngram"
    is a second draft service, over the prompt-lookup drafter).
    `draft_run_ahead`: the model drafter's --run-ahead (auto: off here, on the CPU)."""
    from draft_service.drafters import ModelDrafter
    from draft_service.ngram_drafter import NgramDrafter
    from draft_service.server import start_draft_service
    from specdec.rpc.session_limits import SessionLimits
    from specdec.rpc.serving import ServerConfig
    from target_service.server import start_target_service
    from target_service.verifier import Verifier

    if "orchestrator" in roles:
        roles = tuple(dict.fromkeys((*roles, "target", "draft")))
    tok = tokenizer()
    limits = SessionLimits()
    system = FuzzSystem(tokenizer=tok, max_draft_tokens=limits.max_draft_tokens,
                        _loop=BackgroundLoop(asyncio.new_event_loop, name="fuzz-servers"))
    local = lambda: ServerConfig(host="127.0.0.1", port=0)
    try:
        if "target" in roles:
            t_engine = engine(0, tok)
            target = system._loop.run(start_target_service(
                local(), limits, lambda: Verifier(t_engine, limits.max_draft_tokens, limits.max_verify_batch)))
            system._stops.append(lambda: target.stop(0))
            system.usage["target"] = lambda: (t_engine.num_sessions, 0)
            system.target_port = target.port
        if "draft" in roles:
            d_engine = engine(1, tok)
            system.model_drafter = ModelDrafter(d_engine, limits.max_draft_tokens, run_ahead=draft_run_ahead)
            draft = system._loop.run(start_draft_service(local(), limits, lambda: system.model_drafter))
            system._stops.append(lambda: draft.stop(0))
            system.usage["draft"] = lambda: (d_engine.num_sessions, 0)
            system.draft_port = draft.port
        if "ngram" in roles:
            ngram = NgramDrafter(ROWS, max_context=MAX_CONTEXT, max_sessions=MAX_SESSIONS,
                                 max_draft_tokens=limits.max_draft_tokens)
            drafter = system._loop.run(start_draft_service(local(), limits, lambda: ngram, backend_kind="ngram"))
            system._stops.append(lambda: drafter.stop(0))
            system.ngram_port = drafter.port
            system.usage["ngram"] = ngram.usage
        if "orchestrator" in roles:
            _start_orchestrator(system, tok, http)
    except BaseException:
        system.close()
        raise
    return system


def _start_orchestrator(system: FuzzSystem, tok, http: bool) -> None:
    from orchestrator.config import OrchestratorConfig
    from orchestrator.openai_api.config import HttpConfig
    from orchestrator.server import start_orchestrator
    from specdec.rpc.serving import ServerConfig

    cfg = OrchestratorConfig(target=f"127.0.0.1:{system.target_port}", draft=f"127.0.0.1:{system.draft_port}",
                             connect_timeout_s=10, rpc_timeout_s=30, target_recovery_s=5,
                             max_tokens_limit=64, default_max_tokens=4)
    orch = system._loop.run(start_orchestrator(ServerConfig(host="127.0.0.1", port=0), cfg, tokenizer=tok,
                                               http=HttpConfig(http_port=0, http_request_timeout_s=60)
                                               if http else None))
    system._stops.append(lambda: orch.stop(0))
    system.orchestrator_port = orch.port
    system.http_port = orch.http.port if orch.http is not None else 0
