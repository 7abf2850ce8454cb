"""`specd models rank-vocab MODEL`: rank a draft model's vocabulary by token
frequency on a corpus disjoint from the benchmark's prompts, and store the
ranking with the model (`vocab_rank.json`), for `--draft-vocab N`.

    specd models rank-vocab qwen2.5-coder-0.5b-instruct [--generate-with qwen2.5-coder-1.5b-instruct]
"""
from __future__ import annotations

import argparse
import sys
import time

from specdec.cli.exits import EXIT_ERROR, EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "rank-vocab",
        help="rank a draft's vocabulary for --draft-vocab",
        description="Count token frequencies over the Python standard library's source on this machine (and, "
        "with --generate-with, text a target model generates from prompts the benchmark does not use), and "
        "store the ranking in the model's directory as vocab_rank.json.",
    )
    parser.add_argument("model", metavar="MODEL", help="catalog name or model directory (the ranking is written there)")
    parser.add_argument("--generate-with", default="", metavar="TARGET",
                        help="also count text this model generates (its chat template) from ranking-only prompts")
    parser.add_argument("--generated-tokens", type=int, default=96, help="tokens per generated answer (default 96)")
    parser.add_argument("--max-files", type=int, default=0, help="standard-library files at most (0: all)")
    parser.set_defaults(func=run_rank_vocab)


def run_rank_vocab(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from specdec.engine.draft_vocab import rank_tokens, save_ranking
    from specdec.engine.loading import tokenizer_fingerprint
    from specdec.errors import NotFound
    from specdec.models.cache import locate
    from specdec.models.vocab_corpus import stdlib_sources

    started = time.perf_counter()
    try:
        where, gguf = locate(args.model)
    except NotFound as error:
        print(f"specd: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    if gguf:
        print("specd: error: rank a converted model directory (specd models fetch), not a .gguf", file=sys.stderr)
        return EXIT_ERROR
    tokenizer = AutoTokenizer.from_pretrained(where)
    streams, files = [], 0
    for _path, text in stdlib_sources(args.max_files):
        streams.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        files += 1
    corpus = f"Python {sys.version.split()[0]} standard library source ({files} files)"
    if args.generate_with:
        generated = _generate(args.generate_with, args.generated_tokens)
        streams += [tokenizer(t, add_special_tokens=False)["input_ids"] for t in generated]
        corpus += f" + {len(generated)} answers of {args.generate_with} to ranking-only prompts"
    counted = sum(len(s) for s in streams)
    ranked = rank_tokens(streams)
    path = save_ranking(where, ranked, tokenizer_fingerprint(tokenizer, len(tokenizer)), corpus, counted)
    print(f"{path}: {len(ranked)} distinct ids ranked over {counted} tokens ({corpus}) "
          f"in {time.perf_counter() - started:.0f} s")
    return EXIT_OK


def _generate(model_name: str, tokens: int) -> list[str]:
    from specdec.engine.config import EngineConfig
    from specdec.engine.loading import load_model
    from specdec.models.vocab_corpus import generated_texts

    loaded = load_model(EngineConfig(model=model_name))
    return list(generated_texts(loaded.model, loaded.tokenizer, tokens))
