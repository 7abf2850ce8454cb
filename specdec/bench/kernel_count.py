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
Then the same count for the draft's picks after a step (its tokens, and q
when sampling; `sampling/draft_picks.py`), at Qwen's vocabulary. On a CPU a
list made a tensor launches nothing; on a GPU it is one copy to the device
more for each sampled group (its uniforms) and each group of a mixed step
(its rows), in this count's before and after alike.
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


PICK_CASES = (("greedy", 0.0, 0, 1.0), ("T = 0.7", 0.7, 0, 1.0), ("T = 0.7, top-k 50", 0.7, 50, 1.0),
              ("T = 0.7, top-p 0.9", 0.7, 0, 0.9))


def count_picks(temperature: float, top_k: int, top_p: float, batch: int, mixed: bool = False,
                vocab: int = 151936, max_q_tokens: int = 32) -> int:
    """Operations the draft's picks of one step launch (`draft_picks.pick_on_device`,
    bf16 logits [batch, vocab]); `mixed`: every other row greedy."""
    import torch

    from specdec.sampling.draft_picks import DraftRow, pick_on_device
    from specdec.sampling.params import SamplingParams

    params = SamplingParams(temperature, top_k, top_p)
    greedy = SamplingParams(0.0, 0, 1.0)
    rows = [DraftRow(greedy if mixed and i % 2 else params, 7 + i, 100 + i) for i in range(batch)]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    pick_on_device(logits, rows, max_q_tokens)  # as in steady state: what is made once per vocabulary, made
    counts: collections.Counter = collections.Counter()
    with launch_counter(counts):
        pick_on_device(logits, rows, max_q_tokens)
    return sum(counts.values())


def picks_table() -> list[str]:
    lines = ["| the draft's picks of one step | 1 row | 8 rows | 8 rows, every other one greedy |", "|---|---|---|---|"]
    for label, temperature, top_k, top_p in PICK_CASES:
        cells = [count_picks(temperature, top_k, top_p, 1), count_picks(temperature, top_k, top_p, 8),
                 count_picks(temperature, top_k, top_p, 8, mixed=True) if temperature else "-"]
        lines.append(f"| {label} | " + " | ".join(str(c) for c in cells) + " |")
    return lines


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
    print()
    print("\n".join(picks_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
