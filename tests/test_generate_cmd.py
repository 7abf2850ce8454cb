"""`specd generate --wait`: an orchestrator that listens but is still
connecting to its services answers UNAVAILABLE; the command waits that out
(within --wait) instead of failing, as `specd up` followed at once by
`specd generate --wait` (the README's main job) needs."""
from __future__ import annotations

import types

import grpc
import pytest

import orchestrator.client
from specdec.cli.main import main


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the orchestrator is still connecting to its services"


def fake_client(refusals: int, calls: list):
    class FakeClient:
        last_stats = None

        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def generate(self, prompt, **kwargs):
            calls.append(prompt)
            if len(calls) <= refusals:
                raise Unavailable()
            yield types.SimpleNamespace(text="ok", token_ids=[7])

    return FakeClient


@pytest.mark.parametrize("wait,refusals,rc", [(30, 2, 0), (0, 1, 1)])
def test_generate_waits_out_an_orchestrator_still_connecting(monkeypatch, capsys, wait, refusals, rc):
    calls = []
    monkeypatch.setattr(orchestrator.client, "Client", fake_client(refusals, calls))
    assert main(["generate", "--wait", str(wait), "--temperature", "0", "hello"]) == rc
    out, err = capsys.readouterr()
    if rc == 0:
        assert "ok" in out and len(calls) == refusals + 1
    else:  # no --wait: the first refusal is the answer
        assert "UNAVAILABLE: the orchestrator is still connecting" in err and len(calls) == 1
