"""Faults under load: 16 concurrent mixed streams (greedy and seeded sampled,
short and long) against two target replicas, a draft and an orchestrator,
all child processes on 127.0.0.1 port 0 (`specdec.soak`), while one role is
killed (-9) or drained (SIGTERM) mid-run. Every stream must complete, greedy
streams must equal target-only decoding, and the live services must hold no
session after the drain.

The models are tiny random ones with clear argmax margins (init_range 0.3,
as in test_orchestrator.py), saved to a temporary directory: on them greedy
speculative output is token-identical to target-only decoding, so a
difference is a fault-handling bug, not a near-tie.
"""
from __future__ import annotations

import pytest

from specdec.soak.load import OK, StreamMix
from specdec.soak.report import table
from specdec.soak.run import Fault, SoakConfig, run_soak
from tests.conftest import TINY_VOCAB, tiny_model
from tests.test_orchestrator import perturbed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Every request must complete: no planned cancels or short deadlines here.
MIX = StreamMix(vocab=(3, TINY_VOCAB), prompt_tokens=(4, 24), short_tokens=(8, 24), long_tokens=(48, 96),
                cancel_fraction=0.0, deadline_fraction=0.0, request_timeout_s=120.0)
LOAD_S = 16.0
FAULT_AT_S = 5.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_model(seed=0, init_range=0.3)
    target.save_pretrained(root / "target")
    perturbed(target, 0.15, seed=1).save_pretrained(root / "draft")
    return str(root / "draft"), str(root / "target")


def soak_with(pair, tmp_path, fault: Fault) -> dict:
    draft, target = pair
    cfg = SoakConfig(draft=draft, target=target, streams=16, seconds=LOAD_S, replicas=2, mix=MIX,
                     faults=(fault,), check_greedy=True, max_context=512,
                     orchestrator_flags=("--draft-retry-s", "1"))
    result = run_soak(cfg, tmp_path / "logs")
    print(table(result))  # shown with -s, and on a failure
    return result


def assert_every_stream_completed(result: dict) -> None:
    assert result["by_status"] == {OK: result["requests"]}, result["unplanned_examples"]
    assert result["requests"] >= 16
    g = result["greedy_identity"]
    assert g["checked"] >= 4 and g["identical"] == g["checked"], g


def test_kill_one_target_replica_mid_run(pair, tmp_path):
    result = soak_with(pair, tmp_path, Fault("target0", FAULT_AT_S, "SIGKILL"))
    assert result["exit_codes"] == {"target0": -9}
    assert_every_stream_completed(result)
    assert result["target_recoveries"] >= 1, "no request was on the killed replica"
    assert result["sessions_after_drain"] == {"draft": 0, "target0": None, "target1": 0}
    assert result["sessions_expired"] == {"draft": 0, "target0": None, "target1": 0}


def test_kill_the_draft_mid_run(pair, tmp_path):
    result = soak_with(pair, tmp_path, Fault("draft", FAULT_AT_S, "SIGKILL"))
    assert result["exit_codes"] == {"draft": -9}
    assert_every_stream_completed(result)
    assert result["fallback_rounds"] >= 1, "no round ran without the draft"
    assert result["sessions_after_drain"] == {"draft": None, "target0": 0, "target1": 0}


def test_sigterm_drains_a_target_replica(pair, tmp_path):
    result = soak_with(pair, tmp_path, Fault("target0", FAULT_AT_S, "SIGTERM"))
    assert result["exit_codes"] == {"target0": 0}, "the replica should drain and exit cleanly"
    assert_every_stream_completed(result)
    assert result["sessions_after_drain"] == {"draft": 0, "target0": None, "target1": 0}
