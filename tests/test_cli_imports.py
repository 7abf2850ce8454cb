"""`specd` loads a role's service (torch, transformers) only when that role
runs: `specd --help`, `specd generate` (the README's main job's second half)
and the parent of `specd up` used to import torch through `serve`'s flags,
7-10 s on a 2-core VM before a request went out."""
from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.cli.main import build_parser

HEAVY = ("torch", "transformers")


def loaded_after(code: str) -> set[str]:
    """Which of HEAVY a fresh interpreter has imported after running `code`."""
    check = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_command_line_and_generate_import_no_model_code():
    assert loaded_after("import specdec.cli.main") == set()
    assert loaded_after("from specdec.cli.main import build_parser; build_parser().parse_args(['generate', 'x'])") \
        == set()


def test_a_role_s_flags_are_all_there_without_its_service():
    """The flags come from the settings' own modules: every role still offers
    its engine, limits, drafter and TLS flags."""
    parser = build_parser()
    draft = parser.parse_args(["serve", "draft", "--max-q-tokens", "16", "--run-ahead", "on",
                               "--max-draft-tokens", "8", "--session-ttl-s", "5", "--port", "0"])
    assert (draft.max_q_tokens, draft.run_ahead, draft.max_draft_tokens, draft.session_ttl_s) == (16, "on", 8, 5.0)
    target = parser.parse_args(["serve", "target", "--max-verify-batch", "4"])
    assert target.max_verify_batch == 4 and target.port == 50053
    assert parser.parse_args(["serve", "draft"]).port == 50052
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "draft", "--max-verify-batch", "4"])  # a target's limit only
