"""Is greedy speculative output identical to target-only output, and where it
is not, why? (`specd identity`, formerly benchmarks/greedy_identity.py.)

In one process (no services), over the same engine code paths:

- target-only: one token per forward, as a Verify with k = 0 does;
- speculative: the draft proposes k greedy tokens, the target scores
  [last token, x_1..x_k] in one forward, accept while x_i == argmax.

At the first position where the two outputs differ, the diagnosis holds the
target's top-2 logits at that position as each path computed them. If the
two paths' logits differ by rounding (bf16) and the top-2 gap is within that
difference, the flip is a numerical tie, not a logic error; fp32 should then
agree. (Any flip has a top-2 gap of at most twice the paths' difference;
what tells rounding from a logic error is the size of that difference: one
or two bf16 steps at the logits' magnitude, or more.)

Both paths run `max_tokens` forwards whatever they emit, but a request ends
at its first end-of-sequence token (the orchestrator emits nothing from it
on): the outputs compared are the served ones, each cut at its first EOS id
of the target (its generation config's and its tokenizer's, as the
orchestrator counts them). A difference past an EOS both paths emitted at
the same place is not one a client could see.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TopTwo:
    ids: list[int]
    values: list[float]

    @property
    def gap(self) -> float:
        return self.values[0] - self.values[1]

    @classmethod
    def of(cls, logits: torch.Tensor) -> TopTwo:
        top = logits.topk(2)
        return cls([int(i) for i in top.indices.tolist()], [float(v) for v in top.values.tolist()])


@dataclass(frozen=True)
class Difference:
    """The first generated token where the two paths disagree."""

    position: int
    target_only_token: int
    speculative_token: int
    target_only_top2: TopTwo
    speculative_top2: TopTwo
    max_abs_difference: float  # of the two paths' logits at that position


@dataclass(frozen=True)
class PromptResult:
    index: int
    tokens: int
    difference: Difference | None  # None: identical

    @property
    def identical(self) -> bool:
        return self.difference is None


def target_only(target, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens, one forward each; with each position's logits (fp32)."""
    from specdec.engine.engine import ExtendItem

    s = target.open_session(prompt, max_new_tokens=n)
    out, rows, append = [], [], []
    try:
        for _ in range(n):
            logits = target.extend([ExtendItem(s.id, None, append, 1)])[0][-1].float()
            rows.append(logits)
            out.append(int(logits.argmax()))
            append = [out[-1]]
    finally:
        target.close(s.id)
    return out, rows


def speculative(target, draft, prompt: list[int], n: int, k: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens by speculation with k drafts per round; with the
    target's logits at each emitted position (fp32)."""
    from specdec.engine.engine import ExtendItem

    ts, ds = target.open_session(prompt, max_new_tokens=n + k), draft.open_session(prompt, max_new_tokens=n + k)
    history, out, rows = list(prompt), [], []
    t_keep = d_keep = len(prompt)
    try:
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
    finally:
        target.close(ts.id)
        draft.close(ds.id)
    return out[:n], rows[:n]


def eos_ids_of(engine) -> frozenset[int]:
    """The ids that end a request on this target, as the orchestrator takes
    them (`orchestrator.tokenizer.end_ids`)."""
    from orchestrator.tokenizer import end_ids

    return end_ids(engine.info.eos_token_ids, getattr(engine, "tokenizer", None))


def served(tokens: list[int], eos_ids=frozenset()) -> list[int]:
    """The tokens a client receives: those before the first EOS id."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos_ids), tokens)


def first_difference(ref: list[int], ref_rows: list[torch.Tensor], spec: list[int],
                     spec_rows: list[torch.Tensor], eos_ids=frozenset()) -> Difference | None:
    """Where the served outputs (each cut at its first EOS id) first differ,
    over the whole of both: a token against another, or one output ending
    where the other goes on (compared as prefixes, one ending early would
    read as identical). None when they are equal."""
    ref_out, spec_out = served(ref, eos_ids), served(spec, eos_ids)
    if ref_out == spec_out:
        return None
    t = next((j for j, (a, b) in enumerate(zip(ref_out, spec_out)) if a != b), min(len(ref_out), len(spec_out)))
    a, b = ref_rows[t], spec_rows[t]
    return Difference(t, ref[t], spec[t], TopTwo.of(a), TopTwo.of(b), max_abs_difference(a, b))


def max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| over the entries finite in both: the rows past the
    usable vocabulary are -inf in both paths, and -inf - -inf (NaN) made the
    maximum NaN ("nan" printed for every real-pair difference)."""
    finite = torch.isfinite(a) & torch.isfinite(b)
    return float((a[finite] - b[finite]).abs().max()) if bool(finite.any()) else float("nan")


def diagnose(target, draft, prompts: list[list[int]], max_tokens: int, k: int, first_index: int = 0):
    """Yields a PromptResult per prompt, as each is done (numbered from first_index);
    its tokens: the target-only output's, as served (up to its first EOS)."""
    eos = eos_ids_of(target)
    for i, prompt in enumerate(prompts, start=first_index):
        ref, ref_rows = target_only(target, prompt, max_tokens)
        spec, spec_rows = speculative(target, draft, prompt, max_tokens, k)
        yield PromptResult(i, len(served(ref, eos)), first_difference(ref, ref_rows, spec, spec_rows, eos))


def describe(result: PromptResult) -> str:
    """The lines printed for one prompt."""
    d = result.difference
    if d is None:
        return f"prompt {result.index}: identical ({result.tokens} tokens)"

    def top2(t: TopTwo) -> str:
        return f"top-2 ids {t.ids} values {[round(v, 4) for v in t.values]} (gap {t.gap:.4f})"

    return (f"prompt {result.index}: first difference at generated token {d.position}: target-only chose "
            f"{d.target_only_token}, speculative chose {d.speculative_token}\n"
            f"  target-only logits: {top2(d.target_only_top2)}\n"
            f"  speculative logits: {top2(d.speculative_top2)}\n"
            f"  max |difference| of the two paths' logits at that position: {d.max_abs_difference:.4f}")
