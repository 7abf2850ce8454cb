"""Settings of one model engine (shared by the draft and target services)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from specdec.config import opt
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS

AUTO_ON_OFF = ("auto", "on", "off")
QUANTIZE_CHOICES = ("auto", "none", "int8")


@dataclass
class EngineConfig:
    """How to load and run one model. Every field has a flag and an env var
    (see `specdec.config`); bounds are checked by `validate()`."""

    # Model to load: a catalog name (see `specd models list`), a local HF
    # directory, a .gguf file, or a hub id where a hub is reachable.
    model: str = opt("", "model: catalog name, HF directory, .gguf file or hub id")
    # "cpu", "cuda" or "cuda:N".
    device: str = opt("cpu", "cpu, cuda or cuda:N")
    # "auto", "bfloat16", "float16" or "float32". auto: bf16 on a GPU that
    # supports it (else fp16); bf16 on a CPU with native bf16 (else fp32).
    dtype: str = opt("auto", "weights and KV dtype", choices=("auto", "bfloat16", "float16", "float32"))
    # Intra-op threads for CPU forward passes; 0 leaves torch's default.
    threads: int = opt(0, "CPU threads for forward passes (0: torch default)")
    # Attention over the KV store (specdec/engine/attention.py): "sdpa" runs
    # one SDPA call per session (any device; the reference), "triton" one
    # fused kernel per step (CUDA; what CUDA graphs capture); "auto" picks
    # triton on CUDA when the triton package is present, else sdpa.
    attention: str = opt("auto", "attention kernel over the KV store", choices=("auto", "sdpa", "triton"))
    # Open sessions at most (>= 1).
    max_sessions: int = opt(64, "open sessions at most")
    # Tokens one session may hold (prompt + generated + drafted), >= 2. Each
    # session reserves a KV slot of this many tokens.
    max_context: int = opt(4096, "tokens one session may hold (the size of its KV slot)")
    # Bytes of the KV store, allocated at start-up; it holds
    # min(max_sessions, (max_kv_bytes - one token's bytes) // slot bytes)
    # sessions (that token: the scratch position padding reads). 0: automatic
    # (half of the free memory of the device after loading).
    max_kv_bytes: int = opt(0, "KV store bytes for all sessions (0: half the free device memory)")
    # Decode and verify steps at fixed shapes captured as CUDA graphs
    # (static_steps.py): "auto" = on for CUDA, off elsewhere; "off" keeps the
    # eager path, the reference.
    cuda_graphs: str = opt("auto", "capture decode/verify steps as CUDA graphs", choices=AUTO_ON_OFF)
    # The largest step (tokens over all sessions of one forward) that runs
    # as a captured graph; larger ones (prefill chunks) run eagerly. The
    # default covers a verify of 16 sessions at the largest k (limits.py).
    graph_max_tokens: int = opt(16 * (DEFAULT_MAX_DRAFT_TOKENS + 1),
                                "largest step, in tokens, captured as a CUDA graph")
    # A draft's output head over only its N most frequent token ids (the
    # ranking `specd models rank-vocab` stores with the model); 0: all ids.
    draft_vocab: int = opt(0, "draft: output head over the N most frequent token ids (0: all)")
    # Weights of the model's linear layers (engine/quantize.py): "int8" runs
    # them as fbgemm int8 (CPU only; the draft only: the target refuses it);
    # "auto" (the draft service's default) int8 for a draft on a CPU with
    # VNNI whose hidden size is >= 512, else none; a target takes auto as none.
    quantize: str = opt("none", "draft on CPU: int8 weights and activations for the linear layers "
                        "(auto: where int8 pays, see engine/quantize.py)", choices=QUANTIZE_CHOICES)
    # bf16 linear layers on the CPU with weights blocked once for oneDNN
    # (engine/packed_linear.py): the same products, bit for bit, read faster.
    # "auto" packs where a start-up check shows them identical to F.linear's.
    packed_linears: str = opt("auto", "CPU bf16: linear weights pre-packed for oneDNN (same results, faster)",
                              choices=AUTO_ON_OFF)
    # A Llama-family model's layers as nine launches each instead of ~42
    # (engine/fused_decoder.py): "auto" = wherever the model allows (Triton
    # kernels with the triton attention kernel, on CUDA; reference ops, the
    # same logits as transformers, on a CPU); "off" runs the model through
    # transformers.
    fused_layers: str = opt("auto", "Llama-family layers as fused kernels (auto: where the model allows)",
                            choices=AUTO_ON_OFF)
    # Prompt tokens per forward pass during prefill (bounds activation memory).
    prefill_chunk: int = opt(512, "prompt tokens per prefill forward pass")

    def validate(self) -> None:
        for f in fields(self):  # every field with a fixed set of values declares it (opt's choices)
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be {', '.join(choices[:-1])} or {choices[-1]}, "
                                 f"not {getattr(self, f.name)!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda or cuda:N, not {self.device!r}")
        if self.packed_linears == "on" and self.device != "cpu":
            raise ValueError("--packed-linears on runs on the CPU only; use auto or off")
        if self.quantize == "int8" and self.device != "cpu":
            raise ValueError(f"--quantize {self.quantize} runs on the CPU only (fbgemm has no CUDA kernel); "
                             "use --device cpu or --quantize none")
        if self.cuda_graphs == "on" and not self.device.startswith("cuda"):
            raise ValueError("--cuda-graphs on needs a CUDA device (--device cuda or cuda:N)")
        for name, low in (("max_sessions", 1), ("max_context", 2), ("prefill_chunk", 1), ("graph_max_tokens", 1), ("draft_vocab", 0),
                          ("threads", 0), ("max_kv_bytes", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
