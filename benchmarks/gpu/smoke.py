"""GPU pre-flight for specdec's CUDA paths: the first phase of benchmarks/gpu/check.sh quick. From the
repository's root on the GPU machine:

    python benchmarks/gpu/smoke.py          # ~30-60 s on an H100 (estimated), most of it Triton compiles

Dry run on a CPU (plumbing only, tiny sizes): SMOKE_DEVICE=cpu TRITON_INTERPRET=1 python benchmarks/gpu/smoke.py
(there the bf16 kernel line reports ~1e9: Triton's interpreter computes tl.dot on bf16 wrongly; only the
fp32 line means anything on a CPU)

Each check prints one line, and the script keeps going after a failure, so one call shows every problem:
  1. toolchain: a C compiler and Python.h (Triton builds its launcher with them at first launch;
     torch.compile / hf-static too)
  2. the fused Triton kernel on CUDA against a float64 reference (GQA 7:1 and 1:1, head_dim 128 and
     64, contexts past several BLOCK_N blocks, a padding token on the scratch slot), bf16 and fp32
  3. the reference engine (transformers' layers, SDPA per session, no graphs) on its own, then an
     engine as CUDA runs it by default (fused layers, the fused attention kernel, CUDA graphs)
     against it, fp32 and bf16, and the host syncs per captured step (torch.cuda sync debug mode).
     The reference is a check of its own so that its failure is not taken for the default
     engine's (benchmarks/gpu/switches.py turns off only what failed)
  4. the draft's steps run ahead (fed on the device) against stepping one at a time, fp32 and bf16
  5. the draft's picks as CUDA graphs: what capturing a new shape costs, against a replay and the
     eager picks (and a replay gives the eager picks' bits)
"""
from __future__ import annotations

import os
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.getcwd())
DEV = os.environ.get("SMOKE_DEVICE", "cuda")
SMALL = DEV == "cpu"


FAILED = []


def check(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            msg = fn()
            print(f"OK   {name}: {msg} ({time.perf_counter() - t0:.1f}s)", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            FAILED.append(name)
            traceback.print_exc(limit=4)
        return fn
    return wrap


@check("toolchain")
def _():
    from specdec.engine.model_facts import triton_missing, triton_toolchain  # what the engine itself checks

    missing = triton_missing()
    if missing:
        raise RuntimeError(f"the engine would run without Triton here: {missing}")
    import triton

    cc, include = triton_toolchain()
    return f"torch {torch.__version__}, triton {triton.__version__}, cc={cc}, Python.h in {include}"


def reference(q, key, value, base, pos, scale):
    """float64 reference of attend(): token t sees key_base[t] + 0..position[t]."""
    T, Hq, D = q.shape
    Hkv = key.shape[0]
    g = Hq // Hkv
    out = torch.empty(T, Hq, value.shape[-1], dtype=torch.float64)
    q, key, value = q.double().cpu(), key.double().cpu(), value.double().cpu()
    for t in range(T):
        b, p = int(base[t]), int(pos[t])
        k = key[:, b: b + p + 1].repeat_interleave(g, 0)  # [Hq, p+1, D]
        v = value[:, b: b + p + 1].repeat_interleave(g, 0)
        w = torch.softmax((k @ q[t][:, :, None])[:, :, 0] * scale, -1)  # [Hq, p+1]
        out[t] = (w[:, None, :] @ v)[:, 0]
    return out


def kernel_case(dtype, hq, hkv, d, lengths):
    from specdec.engine.triton_attention import attend
    slot = max(lengths) + 8
    n = slot * len(lengths) + 1  # + the scratch position
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(hkv, n, d, generator=gen).to(DEV, dtype)
    value = torch.randn(hkv, n, d, generator=gen).to(DEV, dtype)
    base, pos = [], []
    for s, length in enumerate(lengths):  # the last 3 positions of each session, verify-shaped
        for p in range(max(0, length - 3), length):
            base.append(s * slot); pos.append(p)
        key[:, s * slot + length: (s + 1) * slot] = float("nan")  # stale data must not leak in
    base.append(n - 1); pos.append(0)  # a padding token on the scratch position
    base_t = torch.tensor(base, dtype=torch.long, device=DEV)
    pos_t = torch.tensor(pos, dtype=torch.long, device=DEV)
    q = torch.randn(len(base), hq, d, generator=gen).to(DEV, dtype)
    out = attend(q, key, value, base_t, pos_t, d ** -0.5)
    if DEV == "cuda":
        torch.cuda.synchronize()
    ref = reference(q, key, value, base, pos, d ** -0.5)
    return (out.double().cpu() - ref).abs().max().item()


@check("triton kernel vs float64 reference")
def _():
    lengths = [5, 70, 200] if SMALL else [1, 63, 64, 65, 700, 3000]
    cases = [(7 * 4, 4, 128), (14, 2, 64), (8, 8, 128)] if not SMALL else [(4, 2, 16)]
    out, over = [], False
    # Triton's CPU interpreter computes bf16 dots wrongly: on a CPU, fp32 only.
    for dtype, tol in ((torch.float32, 1e-5),) if SMALL else ((torch.bfloat16, 3e-2), (torch.float32, 1e-5)):
        for hq, hkv, d in cases:
            err = kernel_case(dtype, hq, hkv, d, lengths)
            over |= not err < tol
            out.append(f"{str(dtype)[6:]} {hq}/{hkv}x{d}: {err:.1e}{'' if err < tol else ' <-- over ' + str(tol)}")
    # fp32 over 1e-5 (about 1e-3) would mean tl.dot ran in TF32
    if over:
        raise AssertionError("; ".join(out))
    return "; ".join(out)


REFERENCE_RUNS: dict = {}  # dtype: the reference engine's logits, for the check below


@check("engine: reference (transformers+sdpa eager)")
def _():
    """The reference on its own: if it fails, nothing of the default engine is
    at fault (benchmarks/gpu/switches.py switches nothing off for it)."""
    if SMALL:
        return "skipped on cpu"
    from tests.test_gpu_engine import REFERENCE, cuda_engine, run_script  # the GPU tests' engines and script
    for dtype in ("float32", "bfloat16"):
        REFERENCE_RUNS[dtype] = run_script(cuda_engine(dtype, False, **REFERENCE))
    return "ran, float32 and bfloat16"


@check("engine: graphs+fused vs transformers+sdpa eager")
def _():
    if SMALL:
        return "skipped on cpu"
    if len(REFERENCE_RUNS) < 2:
        return "not compared: the reference engine failed (its own check above says how)"
    from tests.test_gpu_engine import cuda_engine, run_script
    out = []
    for dtype in ("float32", "bfloat16"):
        a, b = run_script(cuda_engine(dtype, True)), REFERENCE_RUNS[dtype]
        err = max((x - y).abs().max().item() for x, y in zip(a, b))
        same = sum(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b))
        out.append(f"{dtype}: max |dlogit| {err:.1e}, argmax equal {same}/{len(a)}")
    return "; ".join(out)


@check("engine: host syncs per captured step")
def _():
    if SMALL:
        return "skipped on cpu"
    from specdec.engine.engine import ExtendItem
    from tests.test_gpu_engine import cuda_engine
    e = cuda_engine("bfloat16", True)
    s = e.open_session(list(range(3, 40)))
    e.extend([ExtendItem(s.id, None, [5], 1)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e.extend([ExtendItem(s.id, None, [6], 1)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    n = len([w for w in caught if "synchroniz" in str(w.message)])
    return f"{n} sync(s) in one decode step (0 expected: host_copy.to_device copies without waiting)"


@check("draft: run ahead vs steps one at a time")
def _():
    """The GPU's draft path (ModelDrafter.chain_steps): the same drafts, q and
    lengths as stepping one at a time, round after round, fp32 and bf16 with
    CUDA graphs; greedy and sampled rows in one batch, streams of different k."""
    if SMALL:
        return "skipped on cpu"
    from draft_service.drafters import ModelDrafter
    from tests.test_draft_run_ahead import chained, one_by_one, rounds
    from tests.test_gpu_engine import cuda_engine
    out = []
    for dtype in ("float32", "bfloat16"):
        stepwise = ModelDrafter(cuda_engine(dtype, True, arch="llama", seed=2), run_ahead="off")
        ahead = ModelDrafter(cuda_engine(dtype, True, arch="llama", seed=2))
        assert ahead.run_ahead, "auto did not turn run ahead on for a CUDA draft"
        assert ahead.engine.steps is not None and ahead.engine.steps.captured, "no CUDA graphs captured"
        expected = rounds(stepwise, (4, 2, 5), 0.0, one_by_one)
        got = rounds(ahead, (4, 2, 5), 0.0, lambda d, st: chained(d, st)[0])
        same = sum(g == e for g_round, e_round in zip(got, expected) for g, e in zip(g_round, e_round))
        total = sum(len(e_round) for e_round in expected)
        # "drafted differently" is what check.sh reads to turn run ahead off for the later phases.
        assert same == total, f"{dtype}: {total - same} of {total} streams drafted differently"
        assert ahead.steps_fed > 0, f"{dtype}: no step ran ahead (the chain fell back to stepping one at a time)"
        out.append(f"{dtype}: {total}/{total} streams the same, {ahead.steps_fed} steps fed on the device")
    return "; ".join(out)


@check("pick graphs: capture cost of a new shape")
def _():
    """What the first step of a new shape pays (the draft's picks captured as a
    CUDA graph, sampling/pick_graphs.py) against a replay and the eager picks,
    on Qwen's vocabulary in bf16: ms, medians of 20 after the capture."""
    if SMALL:
        return "skipped on cpu"
    from specdec.sampling.draft_picks import one_group
    from specdec.sampling.params import SamplingParams
    from specdec.sampling.pick_graphs import PickGraphs

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1000

    graphs = PickGraphs(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(5)
    out = []
    for params in (None, SamplingParams(0.7, 0, 1.0)):
        for rows in (1, 8):
            logits = torch.randn(rows, 151936, device="cuda", generator=gen).to(torch.bfloat16) * 4
            us = None if params is None else [0.1 + 0.1 * i for i in range(rows)]
            us_dev = None if us is None else torch.tensor(us, dtype=torch.float64, device="cuda")
            first = timed(lambda: graphs.run(logits, params, 16, us))
            replay = sorted(timed(lambda: graphs.run(logits, params, 16, us)) for _ in range(20))[10]
            eager = sorted(timed(lambda: one_group(logits, params, 16, us_dev)) for _ in range(20))[10]
            got = graphs.run(logits, params, 16, us)
            want = one_group(logits, params, 16, us_dev)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{rows} rows {params}: replay != eager"
            out.append(f"{'greedy' if params is None else 'T=0.7'} {rows} rows: capture {first:.1f} ms, "
                       f"replay {replay:.3f}, eager {eager:.3f}")
    assert graphs.captures == 4, f"{graphs.captures} captures for 4 shapes"
    return "; ".join(out)


if __name__ == "__main__":
    print(f"{len(FAILED)} check(s) failed: {', '.join(FAILED)}" if FAILED else "all checks ran")
    sys.exit(1 if FAILED else 0)
