"""The corpus a draft vocabulary is ranked on (`specd models rank-vocab`).

It must not overlap the benchmark's prompts (HumanEval and specdec's chat
prompts), or the measured acceptance would flatter the trimmed head. Two
sources, both on any machine with the model:

- the Python standard library's source on this machine (code, docstrings and
  comments: the register of code-completion prompts);
- text the target model itself generates from RANKING_PROMPTS below, which
  the benchmark does not use (the register of chat answers).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterator

# Chat prompts for ranking only: `specd bench` never sends these.
RANKING_PROMPTS = (
    "Explain how a hash map handles collisions, with a short Python example.",
    "Write a Python function that merges overlapping intervals and explain it.",
    "What is the difference between a process and a thread? Answer briefly.",
    "Write a small command-line tool in Python that counts words in a file.",
    "How do I read a CSV file with the csv module and sum one column?",
    "Write a Python class for a least-recently-used cache with get and put.",
    "Describe what a context manager is and write one that times a block.",
    "Write unit tests with pytest for a function that reverses a string.",
)


def stdlib_sources(max_files: int = 0) -> Iterator[tuple[str, str]]:
    """(path, text) of the standard library's .py files, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts)
    for i, path in enumerate(files):
        if max_files and i >= max_files:
            return
        try:
            yield str(path), path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def generated_texts(model, tokenizer, max_new_tokens: int, prompts=RANKING_PROMPTS) -> Iterator[str]:
    """The target's greedy answers to RANKING_PROMPTS, through its chat template."""
    import torch

    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids.to(model.device), max_new_tokens=max_new_tokens, do_sample=False)
        yield tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
