"""specdec/bench/orchestrator_round.py: `specd overhead`'s figure of the orchestrator's own round."""
from __future__ import annotations

from pathlib import Path

from specdec import eventloop
from specdec.bench import hops_report, orchestrator_round
from specdec.bench.orchestrator_round import OrchestratorRound


def test_the_orchestrators_round_is_measured_through_generate_and_its_processes_stop(tmp_path: Path, monkeypatch):
    """One request of each kind through an orchestrator in a process of its
    own: every round drafts k and, the draft being the target's copy,
    keeps them all; the figures are those of real rounds; every process
    started is stopped."""
    started = []  # every process the measurement starts
    spawn = orchestrator_round.spawn_role

    def spawn_role(*args, **kwargs):
        service = spawn(*args, **kwargs)
        started.append(service.proc)
        return service

    class ChildService(orchestrator_round.ChildService):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.process)

    monkeypatch.setattr(orchestrator_round, "ChildService", ChildService)
    monkeypatch.setattr(orchestrator_round, "spawn_role", spawn_role)
    k = 2
    hops_dir = tmp_path / "hops"  # every process records its hops (`specd overhead --hops`)
    hops_dir.mkdir()
    rounds = eventloop.run(orchestrator_round.measure(1, k, threads=1, log_dir=tmp_path, tracing=False,
                                                      new_tokens=24, hops_dir=hops_dir))
    assert [(r.sampling, r.tracing, r.requests) for r in rounds] == [("greedy", False, 1), ("T=0.7", False, 1)]
    for r in rounds:
        assert 0 < r.overhead_s <= r.seen_s < 1.0  # the client's time holds the orchestrator's
        assert 2.5 <= r.tokens_per_round <= k + 1  # k + 1 a round, the last round cut by max_tokens
        assert r.cpu_s is None or r.cpu_s > 0
    text = "\n".join(orchestrator_round.report_lines(rounds))
    assert "| greedy | off |" in text and "| T=0.7 | off |" in text
    assert len(started) == 3  # a target, a draft, an orchestrator
    assert all(process.poll() is not None for process in started), "a process was left running"
    assert len(list(hops_dir.glob("*.hops"))) == 3, "each process records its own hops"
    kinds = hops_report.rounds(hops_report.read_events(hops_dir))
    assert set(kinds) == {"greedy", "sampled"}
    assert all(len(kind.overhead_us) >= 3 for kind in kinds.values()), "rounds were cut into their hops"


def test_the_report_reads_each_kind():
    rounds = [OrchestratorRound("greedy", False, 3, 0.0021, 0.0024, 5.0, 0.0015, new_tokens=64),
              OrchestratorRound("T=0.7", True, 3, 0.0032, 0.0035, 4.9, None, new_tokens=64)]
    text = "\n".join(orchestrator_round.report_lines(rounds))
    assert "| greedy | off | 2.100 | <= 1.0 ms | 2.400 | 5.00 | 1500 |" in text
    assert "| T=0.7 | on | 3.200 | <= 1.0 ms | 3.500 | 4.90 | - |" in text
    assert "median of 3 requests" in text and "64 new tokens" in text
    assert orchestrator_round.report_lines([]) == []
