"""Is greedy speculative output identical to target-only output on the real pair,
and where it is not, why? In-process (no services), the same engine code paths:

- target-only: one token per forward, as a Verify with k = 0 does;
- speculative: the draft proposes k greedy tokens, the target scores
  [last token, x_1..x_k] in one forward, accept while x_i == argmax.

At the first position where the two outputs differ, prints the target's top-2
logits at that position as computed by each path. If the two paths' logits
differ by rounding (bf16) and the top-2 gap is within that difference, the
flip is a numerical tie, not a logic error; fp32 should then agree.

    python benchmarks/greedy_identity.py --prompts 10 --max-tokens 128 --dtype bfloat16 --num-draft-tokens 3
"""
from __future__ import annotations

import argparse

import torch

from specdec.bench.prompts import humaneval_prompts
from specdec.engine.config import EngineConfig
from specdec.engine.engine import ExtendItem, ModelEngine
from specdec.models.catalog import DEFAULT_PAIR


def target_only(target: ModelEngine, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    s = target.open_session(prompt)
    out, rows = [], []
    append: list[int] = []
    for _ in range(n):
        logits = target.extend([ExtendItem(s.id, None, append, 1)])[0][-1].float()
        rows.append(logits)
        out.append(int(logits.argmax()))
        append = [out[-1]]
    target.close(s.id)
    return out, rows


def speculative(target: ModelEngine, draft: ModelEngine, prompt: list[int], n: int, k: int):
    ts, ds = target.open_session(prompt), draft.open_session(prompt)
    history, out, rows = list(prompt), [], []
    t_keep = d_keep = len(prompt)
    while len(out) < n:
        kk = min(k, n - len(out) - 1)
        drafts = []
        logits = draft.extend([ExtendItem(ds.id, d_keep, history[d_keep:], 1)])[0]
        for i in range(kk):
            if i:
                logits = draft.extend([ExtendItem(ds.id, None, [], 1)])[0]
            drafts.append(int(logits[-1].argmax()))
            draft.append_tokens(ds.id, [drafts[-1]])
        scored = target.extend([ExtendItem(ts.id, t_keep, history[t_keep:] + drafts, kk + 1)])[0].float()
        argmax = scored.argmax(-1).tolist()
        m = 0
        while m < kk and drafts[m] == argmax[m]:
            m += 1
        emitted = drafts[:m] + [argmax[m]]
        rows.extend(scored[: m + 1])
        t_keep = d_keep = len(history) + m
        history += emitted
        out += emitted
    target.close(ts.id)
    draft.close(ds.id)
    return out[:n], rows[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-draft-tokens", type=int, default=3, help="tokens drafted per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default=DEFAULT_PAIR.draft)
    ap.add_argument("--target", default=DEFAULT_PAIR.target)
    args = ap.parse_args()
    target = ModelEngine.load(EngineConfig(model=args.target, dtype=args.dtype, threads=args.threads))
    draft = ModelEngine.load(EngineConfig(model=args.draft, dtype=args.dtype, threads=args.threads))
    identical = 0
    for i, text in enumerate(humaneval_prompts(args.prompts)):
        prompt = target.tokenizer(text)["input_ids"]
        ref, ref_rows = target_only(target, prompt, args.max_tokens)
        spec, spec_rows = speculative(target, draft, prompt, args.max_tokens, args.num_draft_tokens)
        if ref == spec:
            identical += 1
            print(f"prompt {i}: identical ({len(ref)} tokens)", flush=True)
            continue
        t = next(j for j, (a, b) in enumerate(zip(ref, spec)) if a != b)
        a, b = ref_rows[t], spec_rows[t]
        top_a, top_b = a.topk(2), b.topk(2)
        print(f"prompt {i}: first difference at generated token {t}: target-only chose {ref[t]}, "
              f"speculative chose {spec[t]}\n"
              f"  target-only logits: top-2 ids {top_a.indices.tolist()} values {[round(v, 4) for v in top_a.values.tolist()]}"
              f" (gap {float(top_a.values[0] - top_a.values[1]):.4f})\n"
              f"  speculative logits: top-2 ids {top_b.indices.tolist()} values {[round(v, 4) for v in top_b.values.tolist()]}"
              f" (gap {float(top_b.values[0] - top_b.values[1]):.4f})\n"
              f"  max |difference| of the two paths' logits at that position: {float((a - b).abs().max()):.4f}",
              flush=True)
    print(f"identical: {identical}/{args.prompts} ({args.dtype}, k={args.num_draft_tokens})")


if __name__ == "__main__":
    main()
