"""`specd models synth NAME --out DIR`: save a random-weight model of a real
architecture (specdec.models.synth), to measure step costs without weights.

An unknown NAME is a usage error: one line on stderr, exit code 2. An --out
that is not empty, or a failed build, exits 1.
"""
from __future__ import annotations

import argparse
import sys

from specdec.cli.exits import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from specdec.models.synth import PREFIX, get_synth, synth_names


def register(commands: argparse._SubParsersAction) -> None:
    """Add `synth` to the `specd models` subcommands."""
    parser = commands.add_parser(
        "synth",
        help="save a random-weight model of a real architecture",
        description="Build a model from a real architecture's config with random weights and save it, with the "
        "family's tokenizer when a cached model has it. Its step costs are the real model's; its outputs are "
        f"noise. Serve one without saving it with --model {PREFIX}NAME.",
    )
    parser.add_argument("name", metavar="NAME", help=f"one of: {', '.join(synth_names())}")
    parser.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="dtype of the weights (default: bfloat16)")
    parser.add_argument("--device", default="cpu", help="where to build it: cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--cache-dir", default=None, help="model cache to take the tokenizer from")
    parser.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    from specdec.models.catalog import ModelNotFoundError
    from specdec.models.synth import save

    try:
        get_synth(args.name)
    except ModelNotFoundError as error:
        print(f"specd: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        out = save(args.name, args.out, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    except (OSError, RuntimeError, ValueError) as error:
        print(f"specd: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    print(out)
    return EXIT_OK
