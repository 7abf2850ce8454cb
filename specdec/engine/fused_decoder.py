"""A Llama-family model's forward pass in fewer, larger kernels.

transformers runs a Llama or Qwen2 layer as 42 operations, each a kernel
launch on a GPU (`python -m specdec.bench.kernel_count`); a decode step of a small model is mostly those launches
(module doc of `fused_ops.py`). `FusedDecoder` runs the same model, from the
same weights, as nine per layer:

    add_rms_norm       residual add + input RMSNorm (no add in the first layer)
    qkv                q, k and v projections as one product (biases included)
    rotary_and_store   rotary embedding of q and k; k and v into the KV store
    attention          the store attention kernel (attention.py), in place
    o_proj
    add_rms_norm       residual add + post-attention RMSNorm
    gate_up            gate and up projections as one product
    silu_mul
    down_proj

plus, once per step, the embedding, the rotary tables (transformers' own
module, so every RoPE scaling it knows stays right), the last add + norm and
the output head. The q/k/v and gate/up projections become parts of one
product each (`fused_linears.fuse_siblings`): each weight is stored once, the
model still runs through transformers as before, and packing or int8 weights
(CPU) convert the one product like any other linear layer.

It replaces the model call in the engine and in the captured steps
(`static_steps.py`) when `--fused-layers` says so (`auto`: for every model it
supports, `why_not` saying why not; Triton kernels beside the triton attention
kernel on CUDA, the reference ops elsewhere). On the CPU its
reference ops repeat transformers' arithmetic op for op, so it computes the
same logits bit for bit (tests/test_fused_decoder.py; also the real Coder 0.5B
and 1.5B, bf16 packed and int8); on a GPU it agrees to rounding (RMSNorm sums
in another order, and cuBLAS may choose another kernel for the merged
products).

Supported: decoder-only Llama-family models whose layers are RMSNorm, q/k/v/o
projections with rotary embedding and a SiLU-gated MLP, with no sliding
window, no q/k norm, no RoPE whose tables depend on the sequence length, and
plain `nn.Linear` projections (`SUPPORTED_TYPES`, `why_not`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.engine.attention import STEP_KWARG, store_attention
from specdec.engine.fused_linears import FusedPart, SharedProduct, fuse_siblings
from specdec.engine.fused_ops import add_rms_norm, rotary_and_store, silu_mul
from specdec.engine.kv_store import StepLayout, StoreCache

SUPPORTED_TYPES = ("llama", "qwen2")


def why_not(model) -> str | None:
    """Why `FusedDecoder` cannot run `model` (None: it can)."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} (fused: {', '.join(SUPPORTED_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (fused: silu)"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"
    if "dynamic" in rope_type or rope_type == "longrope":
        # transformers recomputes these tables from the sequence length on the host: no captured step
        return f"RoPE type {rope_type!r} (its tables depend on the sequence length)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "not the Llama-family module layout"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if not all(type(p) is nn.Linear for p in projections):
            return "projections that are not plain nn.Linear (quantized or packed)"
        if len({p.bias is None for p in projections[:3]}) > 1 or len({p.bias is None for p in projections[3:]}) > 1:
            return "biases on some sibling projections only"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "q/k norms"
    return None


def _identity(linear: nn.Linear) -> nn.Linear:
    return linear


def _shared(part: nn.Module) -> SharedProduct:
    assert isinstance(part, FusedPart), type(part)
    return part.shared[0]


@dataclass
class _Layer:
    """One layer's pieces. The products are looked up on each call: packing or
    int8 (packed_linear.py, quantize.py) may replace them after this is built."""

    index: int
    norm1: torch.Tensor
    norm1_eps: float
    qkv: SharedProduct  # .layer: q, k and v as one product
    q_size: int
    kv_size: int
    head_dim: int
    scaling: float
    attn: nn.Module  # .o_proj
    norm2: torch.Tensor
    norm2_eps: float
    gate_up: SharedProduct  # .layer: gate and up as one product
    mlp: nn.Module  # .down_proj


@dataclass
class FusedOutput:
    logits: torch.Tensor  # [1, T or kept, V], as transformers returns it


class FusedDecoder(nn.Module):
    """Runs `model` (see the module doc); called as the engine calls the model.
    A module, so hooks on a forward pass go here: the model's own forward is
    not called (its submodules' are, for the products and the output head)."""

    def __init__(self, model, use_triton: bool):
        reason = why_not(model)
        if reason is not None:
            raise ValueError(f"fused layers cannot run this model: {reason}")
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: the model stays the weights' one owner
        self.use_triton = use_triton
        inner = model.model
        # q/k/v and gate/up become parts of one product each (fused_linears.py):
        # stored once, and transformers' own forward still runs the model.
        with torch.no_grad():
            fuse_siblings(model, _identity)
        self.layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                index=i, norm1=layer.input_layernorm.weight, norm1_eps=_eps(layer.input_layernorm),
                qkv=_shared(attn.q_proj), q_size=attn.q_proj.out_features, kv_size=attn.k_proj.out_features,
                head_dim=attn.head_dim, scaling=attn.scaling, attn=attn, norm2=layer.post_attention_layernorm.weight,
                norm2_eps=_eps(layer.post_attention_layernorm), gate_up=_shared(mlp.gate_proj), mlp=mlp))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StoreCache,
                logits_to_keep=0, **kwargs) -> FusedOutput:
        layout: StepLayout = kwargs[STEP_KWARG]
        store = cache.store
        model = self.model
        inner = model.model
        hidden = inner.embed_tokens(input_ids[0])  # [T, H]
        cos, sin = inner.rotary_emb(hidden[None], position_ids)  # [1, T, D] each, in the model's dtype
        cos, sin = cos[0], sin[0]
        tokens = hidden.shape[0]
        delta = None
        for layer in self.layers:
            hidden, x = add_rms_norm(hidden, delta, layer.norm1, layer.norm1_eps, self.use_triton)
            qkv = layer.qkv.layer(x)
            q = qkv[:, :layer.q_size].view(tokens, -1, layer.head_dim)
            k = qkv[:, layer.q_size:layer.q_size + layer.kv_size].view(tokens, -1, layer.head_dim)
            v = qkv[:, layer.q_size + layer.kv_size:].view(tokens, -1, layer.head_dim)
            keys, values = store.keys[layer.index], store.values[layer.index]
            q = rotary_and_store(q, k, v, cos, sin, keys, values, layout.write_index, self.use_triton)
            out, _ = store_attention(layer.attn, q.transpose(0, 1)[None], keys, values, None,
                                     scaling=layer.scaling, **{STEP_KWARG: layout})
            delta = layer.attn.o_proj(out.reshape(tokens, -1))
            hidden, x = add_rms_norm(hidden, delta, layer.norm2, layer.norm2_eps, self.use_triton)
            gate_up = layer.gate_up.layer(x)
            delta = layer.mlp.down_proj(silu_mul(gate_up, self.use_triton))
        hidden, x = add_rms_norm(hidden, delta, inner.norm.weight, _eps(inner.norm), self.use_triton)
        if isinstance(logits_to_keep, torch.Tensor):
            x = x[logits_to_keep]
        elif logits_to_keep:
            x = x[-logits_to_keep:]
        return FusedOutput(model.lm_head(x)[None])


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
