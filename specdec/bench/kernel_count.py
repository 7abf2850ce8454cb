"""How many operations one decode step launches per layer, with and without
fused layers (engine/fused_decoder.py): a measure of a small model's step cost
on a GPU, where a step replayed as a CUDA graph costs about what its kernels
cost to launch, that any machine can take.

    python -m specdec.bench.kernel_count [--arch qwen2 llama] [--triton]

Counts the ATen operations a one-token step dispatches (a view or an empty
allocation launches nothing on a GPU and is not counted) and the Triton
kernels it launches, on tiny models of the given architectures with 2 and 4
layers: the difference is two layers' worth. `--triton` runs the Triton
kernels (under TRITON_INTERPRET=1 on a CPU, which the command sets itself).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

NO_LAUNCH = {"view", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "t", "expand", "slice", "select",
             "reshape", "permute", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind",
             "_reshape_alias", "lift_fresh", "unflatten", "chunk", "empty", "empty_like", "empty_strided",
             "promote_types"}
TRITON_LAUNCHERS = (("specdec.engine.triton_attention", "attend"), ("specdec.engine.triton_fused", "add_rms_norm"),
                    ("specdec.engine.triton_fused", "rotary_and_store"), ("specdec.engine.triton_fused", "silu_mul"))


def launch_counter(counts: collections.Counter, paused=lambda: False):
    """A dispatch mode that, while entered, adds each ATen operation that
    launches work (not in NO_LAUNCH) to `counts` by name, except while
    `paused()` says so."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NO_LAUNCH and not paused():
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    return Count()


def count_step(arch: str, layers: int, fused: str, triton: bool) -> collections.Counter:
    """Operations one padded one-token step of a tiny `arch` model dispatches, by name."""
    import importlib

    import torch

    from specdec.bench.overhead_stack import tiny_model
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine

    counts: collections.Counter = collections.Counter()
    inside = [0]  # > 0 while a Triton kernel runs: what the CPU interpreter dispatches is not a launch

    model = tiny_model(arch=arch, layers=layers).to(torch.bfloat16)
    engine = ModelEngine(model, EngineConfig(dtype="bfloat16", max_kv_bytes=1 << 24, max_context=64,
                                             fused_layers=fused, attention="triton" if triton else "sdpa"))
    steps = engine.use_static_steps(8)
    session = engine.open_session([5, 6, 7, 8])
    patched = []
    for module_name, fn_name in TRITON_LAUNCHERS if triton else ():
        module = importlib.import_module(module_name)
        original = getattr(module, fn_name)

        def launch(*args, _original=original, _name=fn_name, **kwargs):
            counts[f"triton:{_name}"] += 1
            inside[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                inside[0] -= 1
        setattr(module, fn_name, launch)
        patched.append((module, fn_name, original))
    try:
        with launch_counter(counts, lambda: inside[0] > 0):
            steps.run([9], [4], [engine.store.base(session.slot)])
    finally:
        for module, fn_name, original in patched:
            setattr(module, fn_name, original)
    return counts


def per_layer(arch: str, fused: str, triton: bool) -> tuple[dict, int]:
    """(launches per layer by name, launches outside the layers)."""
    two, four = count_step(arch, 2, fused, triton), count_step(arch, 4, fused, triton)
    layer = {k: (four[k] - two[k]) / 2 for k in four if four[k] != two[k]}
    outside = sum(two.values()) - 2 * sum(layer.values())
    return layer, int(outside)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", default=["qwen2", "llama"], choices=("qwen2", "llama"))
    p.add_argument("--triton", action="store_true", help="count with the Triton kernels (interpreted on a CPU)")
    args = p.parse_args(argv)
    if args.triton and "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():  # the interpreter must be on before triton is imported
            os.environ["TRITON_INTERPRET"] = "1"
            return os.execv(sys.executable, [sys.executable, "-m", "specdec.bench.kernel_count", *sys.argv[1:]])
    print("| architecture | layers as | launches per layer | by operation | outside the layers |")
    print("|---|---|---|---|---|")
    for arch in args.arch:
        for fused in ("off", "on"):
            layer, outside = per_layer(arch, fused, args.triton)
            by_name = ", ".join(f"{k} {v:g}" for k, v in sorted(layer.items(), key=lambda kv: -kv[1]))
            label = "transformers" if fused == "off" else "fused" + (" (Triton)" if args.triton else " (reference ops)")
            print(f"| {arch} | {label} | {sum(layer.values()):g} | {by_name} | {outside} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
