"""`specd`: serve a role, run all three locally, generate, fetch models.

    specd models fetch | list
    specd serve draft|target|orchestrator [flags]
    specd up                  # the default real pair, three local processes
    specd generate PROMPT     # stream from an orchestrator
"""
from __future__ import annotations

import argparse
import logging
import sys

from specdec.cli import generate_cmd, models_cmd, serve_cmd, up_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Distributed speculative decoding over gRPC.")
    parser.add_argument("--log-level", default="INFO", help="logging level of server roles (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    models_cmd.register(sub)
    serve_cmd.register(sub)
    up_cmd.register(sub)
    generate_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
