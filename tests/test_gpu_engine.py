"""The GPU engine: captured CUDA-graph steps (fused layers and the fused
attention kernel, as a CUDA engine runs by default) against the reference
(transformers' layers, SDPA per session, no graphs), batched against alone,
the fused kernels against their reference ops, and exact speculative decoding
with the orchestrator on the GPU. Marked `gpu`; skipped without CUDA (CI has
none)."""
from __future__ import annotations

import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.engine.engine import ExtendItem, ModelEngine
from tests.conftest import tiny_model
from tests.test_engine import random_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


REFERENCE = dict(attention="sdpa", fused_layers="off")  # with graphs=False: transformers, eager


def cuda_engine(dtype: str, graphs: bool, arch: str = "qwen2", seed: int = 0, **cfg) -> ModelEngine:
    model = tiny_model(arch, seed=seed, init_range=0.3).to(device="cuda", dtype=getattr(torch, dtype))
    cfg = EngineConfig(device="cuda", dtype=dtype, max_context=256, max_kv_bytes=1 << 28,
                       cuda_graphs="on" if graphs else "off", graph_max_tokens=64, **cfg)
    engine = ModelEngine(model, cfg, name=f"tiny-{arch}-cuda")
    engine.warmup()
    return engine


def run_script(engine):
    """Prefill, a verify-shaped batch of mixed lengths, decode steps, a
    rollback: every logits row the engine returns, on the CPU."""
    seqs = [random_tokens(n, seed=40 + n) for n in (5, 33, 12, 70)]
    sessions = [engine.open_session(seq) for seq in seqs]
    out = engine.extend([ExtendItem(s.id, None, [7, 8, 9, 10], 5) for s in sessions])
    for step in range(6):
        out += engine.extend([ExtendItem(s.id, None, [11 + step], 1) for s in sessions])
    engine.rollback(sessions[1].id, 20)
    out += engine.extend([ExtendItem(s.id, None, [3, 4], 3) for s in sessions])
    for s in sessions:
        engine.close(s.id)
    return [o.float().cpu() for o in out]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_graph_steps_equal_eager_steps_in_fp32(arch):
    graphs = cuda_engine("float32", True, arch)
    assert graphs.steps is not None and graphs.steps.captured and graphs.capture_report.buckets > 0
    assert graphs.kernel == "triton" and (graphs.fused is not None) == (arch != "gpt2")
    eager = cuda_engine("float32", False, arch, **REFERENCE)
    assert eager.steps is None and eager.fused is None
    for a, b in zip(run_script(graphs), run_script(eager)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_graph_steps_are_close_to_eager_steps_in_bf16():
    graphs, eager = cuda_engine("bfloat16", True), cuda_engine("bfloat16", False, **REFERENCE)
    outs = list(zip(run_script(graphs), run_script(eager)))
    same = sum(int(torch.equal(a.argmax(-1), b.argmax(-1))) for a, b in outs)
    for a, b in outs:
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    print(f"bf16 argmax identity, graphs vs eager: {same}/{len(outs)} steps")


def test_batched_equals_alone_on_the_gpu_in_fp32():
    engine = cuda_engine("float32", True)
    seqs = [random_tokens(n, seed=60 + n) for n in (9, 40, 17)]
    alone = []
    for seq in seqs:
        s = engine.open_session(seq[:-4])
        alone.append(engine.extend([ExtendItem(s.id, None, seq[-4:], 5)])[0].cpu())
        engine.close(s.id)
    sessions = [engine.open_session(seq[:-4]) for seq in seqs]
    batched = engine.extend([ExtendItem(s.id, None, seq[-4:], 5) for s, seq in zip(sessions, seqs)])
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b.cpu(), atol=1e-4, rtol=0)
        assert torch.equal(a.argmax(-1), b.cpu().argmax(-1))


def test_speculative_greedy_on_the_gpu_equals_target_alone():
    from tests.harness import running_system
    from tests.test_orchestrator import perturbed

    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.15, seed=1)
    prompts = [random_tokens(n, seed=n) for n in (4, 9, 15)]
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(24):
                ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
            refs.append(ids[len(p):])

    def engine(model):
        e = ModelEngine(model.to("cuda"), EngineConfig(device="cuda", dtype="float32", max_context=256,
                                                       max_kv_bytes=1 << 28, graph_max_tokens=64))
        e.warmup()
        return e

    with running_system(engine(copy_of(target)), engine(draft)) as system:
        for p, ref in zip(prompts, refs):
            result = system.client.complete(p, max_tokens=24, temperature=0, num_draft_tokens=4)
            assert result.token_ids == ref
            assert result.stats.accepted_tokens > 0


def copy_of(model):
    import copy
    return copy.deepcopy(model)


def test_fused_kernels_on_the_gpu_round_as_the_reference_ops_do():
    """The element-wise kernels repeat transformers' roundings: bit for bit on
    CUDA (the CPU interpreter cannot show it: it truncates bf16 casts). RMSNorm
    sums in another order: within rounding."""
    from specdec.engine import fused_ops as F

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        T, H, Hq, Hkv, D, N = 7, 896, 14, 2, 64, 300
        h, d = torch.randn(T, H, device="cuda").to(dtype), torch.randn(T, H, device="cuda").to(dtype)
        w = (torch.rand(H, device="cuda") + 0.5).to(dtype)
        ref_h, ref_x = F.add_rms_norm(h.clone(), d, w, 1e-6)
        got_h, got_x = F.add_rms_norm(h.clone(), d, w, 1e-6, use_triton=True)
        assert torch.equal(got_h, ref_h)  # the residual add: one rounding, the same
        torch.testing.assert_close(got_x, ref_x, atol=2 ** -6, rtol=2 ** -6)  # a unit or two in the last place
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda").to(dtype)
        cos, sin = torch.randn(T, D, device="cuda").to(dtype), torch.randn(T, D, device="cuda").to(dtype)
        write = torch.tensor([3, 9, 10, 11, 30, 31, 299], device="cuda")
        results = []
        for use_triton in (False, True):
            x = qkv.clone()
            q, k, v = x[:, :Hq * D].view(T, Hq, D), x[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), x[:, (Hq + Hkv) * D:].view(T, Hkv, D)
            keys, values = torch.zeros(Hkv, N, D, dtype=dtype, device="cuda"), torch.zeros(Hkv, N, D, dtype=dtype, device="cuda")
            results.append((F.rotary_and_store(q, k, v, cos, sin, keys, values, write, use_triton).clone(), keys, values))
        for a, b in zip(*results):
            assert torch.equal(a, b)
        gate_up = torch.randn(T, 2 * 4864, device="cuda").to(dtype)
        ref, got = F.silu_mul(gate_up), F.silu_mul(gate_up, use_triton=True)
        ulps = 2 ** -7 if dtype == torch.bfloat16 else 1e-6  # the exp may differ by an fp32 ulp
        torch.testing.assert_close(got, ref, atol=ulps, rtol=ulps)
        print(f"{dtype}: silu_mul bit-identical on {torch.eq(got, ref).float().mean().item():.4%} of elements; "
              f"rms_norm on {torch.eq(got_x, ref_x).float().mean().item():.4%}")


def test_a_saved_checkpoint_loads_straight_onto_the_gpu_as_it_would_through_the_cpu(tmp_path):
    """load_model on CUDA: device_map puts the weights on the GPU as they are read (no whole
    model in host memory), with no dispatch hooks (they would run inside captured graphs),
    and the engine computes what a model loaded on the CPU and moved computes."""
    model = tiny_model("qwen2", seed=3, init_range=0.3)
    model.save_pretrained(tmp_path)
    engine = ModelEngine.load(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", max_context=256,
                                           max_kv_bytes=1 << 28, graph_max_tokens=64))
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert not any(hasattr(m, "_hf_hook") for m in engine.model.modules())
    engine.warmup()
    moved = cuda_engine("float32", True, seed=3)  # the same weights, built on the CPU and moved
    for a, b in zip(run_script(engine), run_script(moved)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
