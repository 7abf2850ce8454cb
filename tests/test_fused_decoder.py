"""Fused layers (specdec/engine/fused_decoder.py): the same model computed in
fewer kernels. On the CPU the reference ops must give transformers' logits bit
for bit; the Triton kernels (run here under TRITON_INTERPRET=1) must agree
with the reference ops to rounding. The GPU checks are in test_gpu_engine.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.engine.engine import ModelEngine
from specdec.engine.fused_decoder import FusedDecoder, why_not
from specdec.engine.fused_linears import FusedPart
from specdec.engine.packed_linear import bf16_packing_runs
from tests.conftest import tiny_model
from tests.test_engine import random_tokens
from tests.test_gpu_engine import run_script as script  # the engine script the GPU tests run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_for(arch: str, dtype: str, fused: str, static: bool = False, seed: int = 3) -> ModelEngine:
    model = tiny_model(arch, seed=seed, init_range=0.3).to(getattr(torch, dtype))
    engine = ModelEngine(model, EngineConfig(dtype=dtype, max_kv_bytes=1 << 24, fused_layers=fused, max_context=256),
                         name=f"tiny-{arch}")
    if static:
        engine.use_static_steps(64)  # padded fixed-shape steps, as captured on CUDA
    return engine


@pytest.mark.parametrize("static", [False, True], ids=["eager-steps", "padded-steps"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_layers_compute_what_transformers_computes_bit_for_bit(arch, dtype, static):
    fused = engine_for(arch, dtype, "on", static)
    plain = engine_for(arch, dtype, "off", static)
    assert fused.fused is not None and plain.fused is None
    for a, b in zip(script(fused), script(plain), strict=True):
        assert torch.equal(a, b)


def test_fused_products_are_stored_once_and_the_model_still_runs_through_transformers():
    model = tiny_model("qwen2", seed=5, init_range=0.3)
    ids = torch.tensor([random_tokens(12, seed=1)])
    with torch.inference_mode():
        before = model(ids).logits
    params_before = sum(p.numel() for p in model.parameters())
    decoder = FusedDecoder(model, use_triton=False)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj, FusedPart) and isinstance(mlp.up_proj, FusedPart)
    assert decoder.layers[0].qkv.layer.weight.shape[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    assert sum(p.numel() for p in model.parameters()) == params_before  # each weight once
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("weights", ["int8", "packed"])
def test_int8_and_packed_products_run_fused_as_they_run_alone(weights):
    """Packing (bf16) and int8 convert the fused products like any other
    linear layer, after the fused decoder is built: the same logits."""
    if weights == "packed" and not bf16_packing_runs():
        pytest.skip("oneDNN has no bf16 on this CPU: nothing to pack")
    dtype = "bfloat16" if weights == "packed" else "float32"
    outs = []
    for fused in ("off", "on"):
        engine = engine_for("qwen2", dtype, fused)
        if weights == "int8":
            engine.quantize_weights("int8")
        else:
            engine.pack_weights()
        outs.append(script(engine))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_models_fused_layers_cannot_run_are_named_and_auto_leaves_them_alone():
    gpt2 = tiny_model("gpt2")
    assert "model type 'gpt2'" in why_not(gpt2)
    with pytest.raises(ValueError, match="--fused-layers on cannot run this model: model type 'gpt2'"):
        ModelEngine(gpt2, EngineConfig(dtype="float32", max_kv_bytes=1 << 24, fused_layers="on"))
    assert ModelEngine(tiny_model("gpt2"), EngineConfig(dtype="float32", max_kv_bytes=1 << 24)).fused is None
    # auto: wherever the model allows, the CPU too (reference ops).
    auto = ModelEngine(tiny_model("qwen2"), EngineConfig(dtype="float32", max_kv_bytes=1 << 24))
    assert auto.fused is not None and not auto.fused.use_triton
    qwen2 = tiny_model("qwen2")
    qwen2.model.layers[1].mlp.up_proj = torch.nn.Identity()
    assert "not plain nn.Linear" in why_not(qwen2)
    sliding = tiny_model("qwen2")
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    assert why_not(sliding) == "sliding-window layers"
    dynamic = tiny_model("llama")
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "RoPE type 'dynamic'" in why_not(dynamic)


def _run_interpreted(code: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


KERNELS_CHECK = textwrap.dedent("""
    import torch
    from specdec.engine import fused_ops as F
    torch.manual_seed(0)
    # Under the interpreter bf16 casts are not rounded as a GPU rounds them:
    # bf16 results agree to a unit or two in the last place there (exactly on CUDA: test_gpu_engine.py).
    tolerance = {torch.float32: dict(atol=2e-6, rtol=1e-6), torch.bfloat16: dict(atol=2 ** -6, rtol=2 ** -6)}
    for dtype in (torch.float32, torch.bfloat16):
        tol = tolerance[dtype]
        T, H = 5, 96
        h = torch.randn(T, H).to(dtype)
        d = torch.randn(T, H).to(dtype)
        w = (torch.rand(H) + 0.5).to(dtype)
        for delta in (None, d):
            ref = F.add_rms_norm(h.clone(), delta, w, 1e-6)
            fused = F.add_rms_norm(h.clone(), delta, w, 1e-6, use_triton=True)
            for a, b in zip(ref, fused):
                torch.testing.assert_close(b, a, **tol)
        Hq, Hkv, D, N = 4, 2, 16, 40
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D).to(dtype)
        cos, sin = torch.randn(T, D).to(dtype), torch.randn(T, D).to(dtype)
        write = torch.tensor([3, 9, 10, 11, 30])
        results = []
        for use_triton in (False, True):
            x = qkv.clone()
            q = x[:, :Hq * D].view(T, Hq, D)
            k = x[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
            v = x[:, (Hq + Hkv) * D:].view(T, Hkv, D)
            keys = torch.full((Hkv, N, D), 7.0, dtype=dtype)
            values = torch.full((Hkv, N, D), 7.0, dtype=dtype)
            rotated = F.rotary_and_store(q, k, v, cos, sin, keys, values, write, use_triton=use_triton)
            results.append((rotated.clone(), keys, values))
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, **tol)
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[write] = False
        assert (results[1][1][:, untouched] == 7).all() and (results[1][2][:, untouched] == 7).all()
        assert torch.equal(results[1][2][:, write], results[0][2][:, write])  # values are copied, not rounded
        gate_up = torch.randn(T, 2 * 80).to(dtype)
        torch.testing.assert_close(F.silu_mul(gate_up, use_triton=True), F.silu_mul(gate_up), **tol)
    print("ok")
""")


def test_triton_kernels_agree_with_the_reference_ops():
    proc = _run_interpreted(KERNELS_CHECK)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# Qwen2 alone under the interpreter (~45 s a model on the dev VM): the Triton
# kernels are the same for both architectures, and what differs, the q/k/v
# biases, is torch's part of a fused layer, checked bit for bit against
# transformers for both above; on a GPU both run (test_gpu_engine.py).
ENGINE_CHECK = textwrap.dedent("""
    import torch
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine
    from tests.conftest import tiny_model
    from tests.test_gpu_engine import run_script as script
    for arch in ("qwen2",):
        outs = []
        for attention, fused in (("sdpa", "off"), ("triton", "on")):
            model = tiny_model(arch, seed=3, init_range=0.3)
            engine = ModelEngine(model, EngineConfig(dtype="float32", max_kv_bytes=1 << 24, max_context=256,
                                                     attention=attention, fused_layers=fused))
            assert (engine.fused is not None) == (fused == "on") and engine.fused is None or engine.fused.use_triton
            engine.use_static_steps(64)
            outs.append(script(engine))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    print("ok")
""")


def test_fused_triton_layers_in_the_engine_agree_with_transformers():
    proc = _run_interpreted(ENGINE_CHECK)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_a_fused_layer_launches_nine_kernels_where_transformers_launches_forty():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-m", "specdec.bench.kernel_count", "--arch", "qwen2", "--triton"],
                          env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[2].strip(): float(line.split("|")[3]) for line in proc.stdout.splitlines()
            if line.startswith("| qwen2")}
    assert rows["fused (Triton)"] == 9, proc.stdout
    assert rows["transformers"] >= 40, proc.stdout
