"""Fuzz at depth, CI size (issue 16, item 7): messages drawn from the protobuf
contract (`specdec.fuzz`) sent to live draft, target and orchestrator servers
and to the HTTP front door (tiny models, 127.0.0.1:0, started once for the
module; the draft service also over the prompt-lookup drafter, "ngram"), with
a witness session running beside the fuzzing.

Oracles: no INTERNAL/UNKNOWN (no 5xx over HTTP), no call past its deadline,
every call valid by the contract succeeds and every invalid one is refused,
and the witness produces exactly what it produced alone. A violation fails the
hypothesis example, which is then shrunk.

SPECD_FUZZ_MESSAGES sets the messages per service (default 250 here); the
full run is `python -m specdec.fuzz --messages 10000` (docs/reliability.md).
"""
from __future__ import annotations

import os
import threading

import grpc
import pytest

from specdec.fuzz import system as fuzz_system
from specdec.fuzz.front_doors import expect_generate
from specdec.fuzz.oracle import Expect, Outcome, Tally, Witness
from specdec.fuzz.run import fuzz_service
from specdec.v1 import orchestrator_pb2 as pb

MESSAGES = int(os.environ.get("SPECD_FUZZ_MESSAGES", "250"))
SCALE = {"target": 1.0, "draft": 1.0, "ngram": 1.0, "orchestrator": 0.5, "http": 0.3}  # the slower front doors get fewer in CI


@pytest.fixture(scope="module")
def fuzzed(one_thread):
    with fuzz_system.start(("target", "draft", "ngram", "orchestrator"), http=True) as running:
        yield running


@pytest.mark.parametrize("service", ["target", "draft", "ngram", "orchestrator", "http"])
def test_fuzzed_messages_break_nothing(fuzzed, service):
    tally = Tally(strict=True)
    wanted = max(20, int(MESSAGES * SCALE[service]))
    summary = fuzz_service(fuzzed, service, wanted, tally, seed=0)
    assert not tally.violations, tally.report()
    assert summary["messages"] >= wanted and summary["witness_runs"] >= 1
    statuses = tally.by_status(service)
    ok = statuses["200" if service == "http" else "OK"]
    refused = statuses["400" if service == "http" else "INVALID_ARGUMENT"]
    # The fuzz reached past the first checks: calls succeeded and calls were refused.
    assert ok > wanted // 10 and refused > wanted // 20, tally.report()
    # The calls of a round went as unary calls, on the call streams and on the lane (a drafter
    # gets a few ProposeAll calls a run, among its Propose streams: two of the three carriers).
    unary = {"target": "Verify", "draft": "ProposeAll", "ngram": "ProposeAll"}.get(service)
    if unary:
        sent = {rpc for (_, rpc, _) in tally.counts} & {unary, unary + "Stream", unary + "Lane"}
        assert len(sent) >= (3 if service == "target" else 2), sent


def test_fuzzed_messages_break_nothing_with_the_draft_steps_run_ahead(one_thread):
    """The draft service and the orchestrator over a model drafter whose
    steps run ahead (ModelDrafter.chain_steps, forced on: auto is on for a
    GPU only), with the same oracles."""
    with fuzz_system.start(("draft", "orchestrator"), draft_run_ahead="on") as running:
        for service in ("draft", "orchestrator"):
            tally = Tally(strict=True)
            wanted = max(20, int(MESSAGES * SCALE[service] / 2))
            summary = fuzz_service(running, service, wanted, tally, seed=1)
            assert not tally.violations, tally.report()
            assert summary["messages"] >= wanted and summary["witness_runs"] >= 1
            assert tally.by_status(service)["OK"] > wanted // 10, tally.report()
        assert running.model_drafter.steps_fed > 0, "no step ran ahead"


# ------------------------------------------------------- the oracles themselves

def test_the_status_oracles_flag_what_they_must():
    tally = Tally()
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.INTERNAL, "boom"), Expect.ANY)
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.UNKNOWN, "x"), Expect.ANY)
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), Expect.ANY)
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.NOT_FOUND, ""), Expect.ANY)
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.INVALID_ARGUMENT, "bad"), Expect.OK)
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.OK), Expect.FAIL)
    assert len(tally.violations) == 6
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.OUT_OF_RANGE, "past the end"), Expect.FAIL)
    tally.check("target", "Rollback", Outcome(grpc.StatusCode.OK), Expect.OK)
    assert len(tally.violations) == 6 and tally.sent("target") == 8
    with pytest.raises(AssertionError, match="INTERNAL"):
        Tally(strict=True).check("draft", "Propose", Outcome(grpc.StatusCode.INTERNAL, "x"), Expect.ANY)


def test_the_witness_flags_a_different_result():
    results = iter([[1, 2], [1, 2], [1, 3]])  # alone before, once on its thread, alone after
    checked_on_thread = threading.Event()

    def run():
        result = next(results)
        if threading.current_thread() is not threading.main_thread():
            checked_on_thread.set()
        return result

    tally = Tally()
    witness = Witness("target", run, tally, pause_s=3600).start()  # one run on the thread, then it waits
    assert checked_on_thread.wait(60)
    witness.stop()  # its last run differs
    assert witness.runs == 2 and len(tally.violations) == 1 and "differs" in tally.violations[0].what


def test_generate_validity_follows_the_contract():
    tok = fuzz_system.tokenizer()
    ok = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(token_ids=[5, 6]), max_tokens=4)
    assert expect_generate(ok, tok, 8) == (Expect.OK, 4)
    for edge in (0.0, 1.0):
        sure = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(token_ids=[5, 6]), max_tokens=4,
                                  speculation=pb.SpeculationOptions(draft_min_confidence=edge))
        assert expect_generate(sure, tok, 8) == (Expect.OK, 4)
    bad = [
        pb.GenerateRequest(max_tokens=4),  # no input
        pb.GenerateRequest(prompt_token_ids=pb.TokenIds(token_ids=[fuzz_system.USABLE_VOCAB])),  # a padded id
        pb.GenerateRequest(prompt="hi", max_tokens=65),
        pb.GenerateRequest(prompt="hi", temperature=float("nan")),
        pb.GenerateRequest(prompt="hi", top_p=0.0),
        pb.GenerateRequest(prompt="hi", stop=[""]),
        pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(num_draft_tokens=9)),
        pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(min_draft_tokens=5)),
        # the early stop is a probability: the fuzzer's seed 1616 sent these, the oracle called them valid
        pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(draft_min_confidence=1.0000001)),
        pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(draft_min_confidence=float("-inf"))),
        pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(draft_min_confidence=float("nan"))),
        pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="tool", content="x")])),
    ]
    assert [expect_generate(r, tok, 8)[0] for r in bad] == [Expect.FAIL] * len(bad)
