"""Settings of one model engine (shared by the draft and target services)."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import opt


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
    # "sdpa" or "eager".
    attn_implementation: str = opt("sdpa", "attention kernel", choices=("sdpa", "eager"))
    # Open sessions at most (>= 1).
    max_sessions: int = opt(64, "open sessions at most")
    # Tokens one session may hold (prompt + generated + drafted), >= 2.
    max_context: int = opt(4096, "tokens one session may hold")
    # Bytes of KV cache all sessions may reserve together; 0: automatic
    # (half of the free memory of the device after loading).
    max_kv_bytes: int = opt(0, "KV cache bytes for all sessions (0: half the free device memory)")
    # Prompt tokens per forward pass during prefill (bounds activation memory).
    prefill_chunk: int = opt(512, "prompt tokens per prefill forward pass")
    # KV capacity reserved when a session opens without a token budget; the
    # buffer grows geometrically up to max_context.
    initial_capacity: int = opt(256, "KV tokens reserved when a session opens without a budget")

    def validate(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, not {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda or cuda:N, not {self.device!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError("attn_implementation must be sdpa or eager")
        for name, low in (("max_sessions", 1), ("max_context", 2), ("prefill_chunk", 1),
                          ("initial_capacity", 1), ("threads", 0), ("max_kv_bytes", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
