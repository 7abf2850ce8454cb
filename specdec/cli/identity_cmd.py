"""`specd identity`: greedy speculative output vs target-only, in one process,
with the target's top-2 logits under each path at the first difference
(specdec/bench/identity.py): are the differences numerical ties?

    specd identity --prompts 10 --max-tokens 128 --dtype bfloat16 --num-draft-tokens 3
    specd identity --prompts 10 --max-tokens 128 --dtype float32 --num-draft-tokens 3
    specd identity --first-prompt 4 --prompts 1 --max-tokens 48    # one prompt of the ten

HumanEval prompts through the target's tokenizer; a target without one (the
tiny pair of `specdec.bench.tiny_pair`) gets that pair's token-id prompts.
"""
from __future__ import annotations

import argparse
import sys

from specdec.cli.exits import EXIT_ERROR, EXIT_OK
from specdec.cli.model_flags import add_device, add_dtype, add_threads
from specdec.models.catalog import DEFAULT_PAIR


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("identity", help="greedy identity of speculative vs target-only output, with the tie diagnosis",
                       description="In one process, over the engine: target-only greedy (one token per forward) vs "
                       "speculative greedy (k drafts scored in one target forward). Each output is compared as "
                       "served, cut at its first EOS. At the first difference (a token against another, or one "
                       "output ending where the other goes on), print the target's top-2 logits under each path "
                       "and how far the two paths' finite logits differ.")
    p.add_argument("--prompts", type=int, default=10, help="number of prompts (default 10)")
    p.add_argument("--first-prompt", type=int, default=0, help="index of the first prompt (default 0)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    add_dtype(p, default="bfloat16")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="tokens drafted per round (default 3)")
    add_threads(p, default=2)
    add_device(p)
    p.add_argument("--draft", default=DEFAULT_PAIR.draft, help=f"draft model (default {DEFAULT_PAIR.draft})")
    p.add_argument("--target", default=DEFAULT_PAIR.target, help=f"target model (default {DEFAULT_PAIR.target})")
    p.set_defaults(func=run)


def _prompts(target, first: int, n: int) -> list[list[int]]:
    if target.tokenizer is None:
        from specdec.bench.tiny_pair import tiny_prompts

        return tiny_prompts(first + n)[first:]
    from specdec.bench.prompts import humaneval_prompts

    return [target.tokenizer(text)["input_ids"] for text in humaneval_prompts(first + n)[first:]]


def run(args: argparse.Namespace) -> int:
    from specdec.bench.identity import describe, diagnose
    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine
    from specdec.errors import SpecdecError

    if args.prompts < 1 or args.max_tokens < 1 or args.num_draft_tokens < 1 or args.first_prompt < 0:
        print("specd: error: --prompts, --max-tokens and --num-draft-tokens must be at least 1, --first-prompt "
              "at least 0", file=sys.stderr)
        return EXIT_ERROR
    engines = []
    for model in (args.target, args.draft):
        try:
            engines.append(ModelEngine.load(EngineConfig(model=model, dtype=args.dtype, threads=args.threads,
                                                         device=args.device, max_sessions=2)))
        except (SpecdecError, ValueError, OSError) as error:
            print(f"specd: error: {model}: {error}", file=sys.stderr)
            return EXIT_ERROR
    target, draft = engines
    try:
        prompts = _prompts(target, args.first_prompt, args.prompts)
        identical = 0
        if not prompts:
            print(f"specd: error: no prompts from index {args.first_prompt}", file=sys.stderr)
            return EXIT_ERROR
        for result in diagnose(target, draft, prompts, args.max_tokens, args.num_draft_tokens, args.first_prompt):
            identical += result.identical
            print(describe(result), flush=True)
    except SpecdecError as error:
        print(f"specd: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    print(f"identical: {identical}/{len(prompts)} ({args.dtype}, k={args.num_draft_tokens})")
    return EXIT_OK
