"""`specd generate --wait`: an orchestrator that listens but is still
connecting to its services answers UNAVAILABLE; the command waits that out
(within --wait) instead of failing, as `specd up` followed at once by
`specd generate --wait` (the README's main job) needs."""
from __future__ import annotations

import grpc
import pytest

import orchestrator.client
from specdec.v1 import orchestrator_pb2 as pb
from specdec.cli.main import main


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the orchestrator is still connecting to its services"


def fake_stub(refusals: int, calls: list):
    """The orchestrator's stub: its first `refusals` Generate calls answer as an
    orchestrator still connecting to its services does."""
    class FakeStub:
        def __init__(self, channel):
            pass

        def Generate(self, request, **kwargs):
            calls.append(request)
            refuse = len(calls) <= refusals

            def replies():
                if refuse:
                    raise Unavailable()
                yield pb.GenerateResponse(chunk=pb.TextChunk(text="ok", token_ids=[7]))
            return replies()

    return FakeStub


@pytest.mark.parametrize("wait,refusals,rc", [(30, 2, 0), (0, 1, 1)])
def test_generate_waits_out_an_orchestrator_still_connecting(monkeypatch, capsys, wait, refusals, rc):
    calls = []
    monkeypatch.setattr(orchestrator.client.orchestrator_pb2_grpc, "OrchestratorServiceStub", fake_stub(refusals, calls))
    monkeypatch.setattr(orchestrator.client, "RETRY_S", 0.01)
    assert main(["generate", "--wait", str(wait), "--temperature", "0", "hello"]) == rc
    out, err = capsys.readouterr()
    if rc == 0:
        assert "ok" in out and len(calls) == refusals + 1
    else:  # no --wait: the first refusal is the answer
        assert "UNAVAILABLE: the orchestrator is still connecting" in err and len(calls) == 1


def test_generate_sends_the_request_its_flags_build(monkeypatch, capsys):
    """The command builds its request once, checked before connecting, and
    sends that request: every flag reaches the wire."""
    calls = []
    monkeypatch.setattr(orchestrator.client.orchestrator_pb2_grpc, "OrchestratorServiceStub", fake_stub(0, calls))
    assert main(["generate", "--temperature", "0.5", "--seed", "3", "--max-tokens", "9", "--stop", "}",
                 "--num-draft-tokens", "3", "hello"]) == 0
    (request,) = calls
    assert request.prompt == "hello" and request.max_tokens == 9 and list(request.stop) == ["}"]
    assert request.seed == 3 and request.temperature == pytest.approx(0.5)
    assert request.speculation.num_draft_tokens == 3


def test_a_built_request_takes_no_settings_beside_it():
    client = orchestrator.client.Client("127.0.0.1:1", timeout_s=1)
    with pytest.raises(TypeError, match="max_tokens"):
        next(client.generate(pb.GenerateRequest(prompt="x"), max_tokens=3))
    client.close()
