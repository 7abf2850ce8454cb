"""A tiny random draft/target pair for quick benchmarks where the network matters.

`ensure_tiny_pair()` builds (once, deterministically, from a config: nothing is
downloaded) two Llama models that share a 512-token vocabulary and load in
well under a second:

- target: hidden 256, 8 layers, 8 heads (4 KV heads), MLP 512: 4.99 M params;
- draft: the target's embedding, first layer, final norm and LM head (copied),
  so 1 layer: 0.85 M params.

Weights are drawn from N(0, 0.2) with a fixed seed (norms are 1), which gives
peaked distributions (mean top-1 probability at temperature 1 is about 0.35).
The output projections (o_proj, down_proj) of the target's layers 1-7 are
scaled by ``LATE_LAYER_SCALE``: unscaled, seven random layers on top of the
draft's one leave almost no agreement (measured 1-3 %); scaled, the target is
the draft plus a bounded correction, and the scale sets how often they agree.
The target still runs all 8 layers, so it costs what an 8-layer model costs.
There is no EOS token (``eos_token_id`` is unset), so a generation always runs
to its ``max_tokens`` -- what a throughput sweep wants. There is no tokenizer
either: clients send ``prompt_token_ids`` (`tiny_prompts`), and the services
report the fingerprint ``untokenized-vocab-512``, which the orchestrator treats
as unknown (so `specd serve orchestrator --tokenizer ''` accepts the pair).

Measured (torch 2.13 CPU, float32, 1 intra-op thread, this repository's
2-core dev machine; `python -m specdec.bench.tiny_pair` prints them again):

- greedy agreement (the draft's argmax equals the target's on the target's own
  greedy continuation; 32 prompts x 64 new tokens): 0.73;
- expected acceptance of a sampled draft token at temperature 1
  (mean sum_x min(p(x), q(x))): 0.83;
- through the three services with a fixed k = 4 (16 prompts x 64 tokens):
  2.8 tokens per round greedy, 3.3 at temperature 1;
- one decode step (one token, KV cache, context ~100-200) through ModelEngine,
  best of 5 x 100 steps: draft 0.80 ms, target 3.44 ms (4.3x); a bare HF
  forward with DynamicCache: 0.70 ms vs 3.33 ms;
- building the pair: about 1 s (after torch/transformers are imported);
  loading one directory: well under 1 s.

Layout: ``<cache>/tiny-pair/v1/{draft,target}`` (save_pretrained directories:
config.json, generation_config.json, model.safetensors) plus
``<cache>/tiny-pair/v1/tiny-pair.json`` (the build parameters), which is
written last; the whole ``v1`` directory is built in a temporary directory
beside it and renamed into place, so an interrupted build never looks
complete. The cache root is `specdec.models.cache.default_cache_dir()` unless
given. Changing anything that alters the weights must bump ``VERSION``.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import tempfile
import time

__all__ = ["VERSION", "VOCAB_SIZE", "ensure_tiny_pair", "greedy_agreement", "sampled_acceptance", "tiny_prompts"]

VERSION = "v1"
VOCAB_SIZE = 512
SEED = 20240917
INIT_STD = 0.2
TARGET_LAYERS = 8
DRAFT_LAYERS = 1
LATE_LAYER_SCALE = 0.06
FIRST_PROMPT_TOKEN = 3  # ids 0-2 are pad/bos/(unused) eos by convention; prompts avoid them
_MARKER = "tiny-pair.json"


def _config(num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
        initializer_range=INIT_STD, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )


def build_models():
    """(draft, target): the pair as float32 eval-mode models, built in memory
    (deterministic; the global torch RNG is left untouched)."""
    import torch
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(SEED)
    with torch.random.fork_rng(devices=[]):  # from_config's own init draws from the global RNG
        target = AutoModelForCausalLM.from_config(_config(TARGET_LAYERS), dtype=torch.float32,
                                                  attn_implementation="sdpa")
        draft = AutoModelForCausalLM.from_config(_config(DRAFT_LAYERS), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        # Our own initialization, in a fixed order, so the weights do not depend
        # on transformers' init code or on the caller's RNG state.
        for name, param in sorted(target.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
        for index, layer in enumerate(target.model.layers):
            if index >= DRAFT_LAYERS:
                layer.self_attn.o_proj.weight.mul_(LATE_LAYER_SCALE)
                layer.mlp.down_proj.weight.mul_(LATE_LAYER_SCALE)
        target_state = target.state_dict()
        missing = draft.load_state_dict({k: target_state[k] for k in draft.state_dict()}, strict=True)
        assert not missing.missing_keys and not missing.unexpected_keys
    return draft.eval(), target.eval()


def _complete(root: pathlib.Path) -> bool:
    return (root / _MARKER).is_file() and all(
        (root / role / "config.json").is_file() and (root / role / "model.safetensors").is_file()
        for role in ("draft", "target"))


def ensure_tiny_pair(cache_dir: str | pathlib.Path | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """(draft_dir, target_dir): save_pretrained directories (safetensors + config; no tokenizer) under
    <cache>/tiny-pair/v1/{draft,target}; built deterministically on first use (atomic: build in a temp dir, rename), reused after."""
    from specdec.models.cache import default_cache_dir

    parent = (pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "tiny-pair"
    root = parent / VERSION
    if not _complete(root):
        parent.mkdir(parents=True, exist_ok=True)
        building = pathlib.Path(tempfile.mkdtemp(prefix=f".{VERSION}-building-", dir=parent))
        try:
            building.chmod(0o755)  # mkdtemp's 0700 would become the cache entry's mode
            _build_into(building)
            if root.exists() and not _complete(root):
                shutil.rmtree(root)  # left by something else; ours replaces it
            try:
                os.rename(building, root)
            except OSError:
                if not _complete(root):  # not a concurrent builder that won the race
                    raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return root / "draft", root / "target"


def _build_into(root: pathlib.Path) -> None:
    import torch
    import transformers

    draft, target = build_models()
    draft.save_pretrained(root / "draft")
    target.save_pretrained(root / "target")
    marker = {"version": VERSION, "seed": SEED, "vocab_size": VOCAB_SIZE, "init_std": INIT_STD,
              "target_layers": TARGET_LAYERS, "draft_layers": DRAFT_LAYERS,
              "late_layer_scale": LATE_LAYER_SCALE, "torch": torch.__version__,
              "transformers": transformers.__version__}
    (root / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def tiny_prompts(n: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    """n deterministic token-id prompts for the pair."""
    rng = random.Random(f"tiny-pair-prompts/{seed}")
    return [[rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(length)] for _ in range(n)]


def _greedy_continuations(target, prompts, new_tokens: int):
    """The target's greedy continuations (batch of equal-length prompts)."""
    import torch

    from specdec.engine.model_facts import cache_kwarg, output_cache

    seqs = torch.tensor(prompts, dtype=torch.long)
    out = target(seqs, use_cache=True)
    cache = output_cache(out)
    for _ in range(new_tokens):
        nxt = out.logits[:, -1:].argmax(-1)
        seqs = torch.cat([seqs, nxt], dim=1)
        out = target(nxt, use_cache=True, **{cache_kwarg(target): cache})
        cache = output_cache(out)
    return seqs


def _scored(draft, target, prompts, new_tokens: int):
    import torch

    with torch.inference_mode():
        seqs = _greedy_continuations(target, prompts, new_tokens)
        start = len(prompts[0]) - 1
        p_logits = target(seqs).logits[:, start:-1]
        q_logits = draft(seqs).logits[:, start:-1]
    return seqs[:, start + 1:], p_logits, q_logits


def greedy_agreement(draft, target, prompts: list[list[int]], new_tokens: int = 32) -> float:
    """Fraction of positions of the target's greedy continuations where the
    draft's argmax equals the target's token (prompts of equal length)."""
    generated, _p, q_logits = _scored(draft, target, prompts, new_tokens)
    return (q_logits.argmax(-1) == generated).float().mean().item()


def sampled_acceptance(draft, target, prompts: list[list[int]], new_tokens: int = 32) -> float:
    """Mean of sum_x min(p(x), q(x)) at temperature 1 over the same positions:
    the chance that speculative sampling accepts a drafted token."""
    import torch

    _gen, p_logits, q_logits = _scored(draft, target, prompts, new_tokens)
    return torch.minimum(p_logits.softmax(-1), q_logits.softmax(-1)).sum(-1).mean().item()


def _step_ms(model_dir: pathlib.Path, context: int = 100, steps: int = 100, repeats: int = 5) -> float:
    """Wall time of one single-token decode step through ModelEngine (the
    best of `repeats` means over `steps` steps, to damp a shared machine's noise)."""
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ExtendItem, ModelEngine

    engine = ModelEngine.load(EngineConfig(model=str(model_dir), dtype="float32", max_kv_bytes=1 << 28))
    session = engine.open_session(tiny_prompts(1, context, seed=99)[0])
    token = 5
    engine.extend([ExtendItem(session.id, None, [token], 1)])
    best = float("inf")
    for _ in range(repeats):
        engine.extend([ExtendItem(session.id, context, [token], 1)])  # back to `context` tokens
        start = time.perf_counter()
        for _ in range(steps):
            logits = engine.extend([ExtendItem(session.id, None, [token], 1)])[0]
            token = int(logits[-1].argmax())
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1000


def main() -> None:  # pragma: no cover - a measurement, run by hand
    import argparse

    import torch
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description="Build (or find) the tiny pair and measure it.")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    draft_dir, target_dir = ensure_tiny_pair(args.cache_dir)
    print(f"draft  {draft_dir}\ntarget {target_dir}\n(ensure_tiny_pair: {time.perf_counter() - start:.2f} s)")
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompts = tiny_prompts(32)
    print(f"params: draft {sum(p.numel() for p in draft.parameters()):,}, "
          f"target {sum(p.numel() for p in target.parameters()):,}")
    print(f"greedy agreement: {greedy_agreement(draft, target, prompts, 64):.3f}")
    print(f"sampled acceptance (T=1): {sampled_acceptance(draft, target, prompts, 64):.3f}")
    d_ms, t_ms = _step_ms(draft_dir), _step_ms(target_dir)
    print(f"decode step through ModelEngine, 1 thread: draft {d_ms:.2f} ms, target {t_ms:.2f} ms "
          f"({t_ms / d_ms:.1f}x)")


if __name__ == "__main__":  # pragma: no cover
    main()
