"""A review of `specd bench`'s measurement code: each test reproduces, on
synthetic records (no services, no models), a way a published figure could
come out wrong, and checks the fix."""
from __future__ import annotations

import threading
import types

import pytest
import torch

from specdec.bench import analysis as A
from specdec.bench import report
from specdec.bench import runner as runner_module
from specdec.bench.aggregate import build_runs
from specdec.bench.runner import DIRECT, SERVICE, TARGET_ONLY, BenchConfig, Plan, Prompt, Runner
from tests.test_bench import _record, _stats

# ------------------------------------------------------------- the time split


def test_a_pipelined_runs_overlap_shows_in_other_instead_of_being_floored_at_zero():
    """Pipelined drafting computes while the target verifies: the draft's and
    the target's compute add up to more than the request's time. Flooring
    other at 0 printed such a run as "58 / 54 / 0" (docs/benchmarks.md, issue
    6, goodput + pipelining), shares adding up to 112% with no sign of it."""
    pooled = A.pool_stats([_stats(duration_s=10.0, draft_compute_time_s=5.8, target_compute_time_s=5.4,
                                  prefill_time_s=0.0)])
    ts = A.time_split(pooled)
    assert ts["other_s"] == pytest.approx(-1.2) and ts["overlap_s"] == pytest.approx(1.2)
    assert ts["draft_share"] + ts["target_share"] + ts["prefill_share"] + ts["other_share"] == pytest.approx(1.0)
    run = {"policy": "goodput", "time_split": ts}
    assert report._split(run) == "58 / 54 / 0 / -12"
    # Without overlap nothing changes: other is the system's own time, and no overlap.
    plain = A.time_split(A.pool_stats([_stats()]))
    assert plain["other_s"] == pytest.approx(0.6 - 0.1 - 0.2) and plain["overlap_s"] == 0.0


# ----------------------------------------------------------------- tokens/s


def _failed(record: dict, wall: float) -> dict:
    return dict(record, ok=False, error="DEADLINE_EXCEEDED: too slow", error_code="DEADLINE_EXCEEDED",
                completion_tokens=0, token_ids=[], wall_s=wall, unit_wall_s=wall, ttft_s=None, arrivals=[],
                stats=None, tokens_per_s=0.0)


def test_a_failed_requests_time_is_not_divided_into_the_successful_requests_tokens():
    """tok/s is the successful requests' tokens over their units' wall time
    (aggregate.py says so); a request that failed at its deadline added its
    30 s to the denominator and none of its tokens to the numerator."""
    recs = [_record("fixed-k2", SERVICE, "fixed", 2, unit=0, wall=1.0, stats=_stats()),
            _failed(_record("fixed-k2", SERVICE, "fixed", 2, unit=1, prompt=1, wall=30.0), 30.0),
            _failed(_record("adaptive", SERVICE, "adaptive", None, unit=2, wall=5.0), 5.0)]
    runs = {r["config"]: r for r in build_runs(recs)}
    assert runs["fixed-k2"]["tokens_per_s"] == pytest.approx(4.0)  # 4 tokens in 1 s, not 4 in 31 s
    assert runs["fixed-k2"]["errors"] == 1
    assert runs["adaptive"]["tokens_per_s"] is None  # nothing succeeded: no rate, not 0 tok/s


def test_the_projection_is_made_for_the_length_of_the_requests_that_succeeded():
    from specdec.bench.projection_report import request_tokens

    # 2 requests made 64 tokens each, 2 failed: requests of 64 tokens, not 32.
    assert request_tokens({"requests": 4, "errors": 2, "completion_tokens": 128}) == 64
    assert request_tokens({"requests": 2, "errors": 2, "completion_tokens": 0}) is None


# ---------------------------------------------------------------- the waves


def test_a_waves_clients_are_made_and_connected_before_its_clock_starts(monkeypatch):
    """The warm-up uses client 0 of a route only; a wave's other clients were
    made (and their channels connected by their first request) inside the
    first wave's clock, although the code said the clock started after."""
    lock = threading.Lock()
    clock = {"now": 0.0}

    def advance(seconds: float) -> None:
        with lock:
            clock["now"] += seconds

    class FakeClient:
        def __init__(self):
            advance(5.0)  # making a client and connecting its channel: not the wave's time
            self.channel = None
            self.last_stats = None

        def generate(self, token_ids, **kwargs):
            for _ in range(2):
                advance(1.0)
                yield types.SimpleNamespace(token_ids=[7])

        def close(self):
            pass

    class FakeServices:
        def reset_peaks(self):
            pass

        def proxy_bytes(self):
            return None

        def peaks_mb(self):
            return {}

        def gpu_mb(self):
            return None

    def client(self, route, i):
        if (route, i) not in self._clients:
            self._clients[(route, i)] = FakeClient()
        return self._clients[(route, i)]

    monkeypatch.setattr(runner_module, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    monkeypatch.setattr(Runner, "_client", client)
    prompts = [Prompt(i, "tokens", (3, 4, 5), 1 + i) for i in range(2)]
    plan = Plan(configs=[BenchConfig(TARGET_ONLY, SERVICE, "none")], prompts=prompts, temperatures=[0.0],
                concurrency=[2], repeats=1, conditions=[DIRECT], max_tokens=2)
    records = Runner(plan, services=FakeServices(), progress=False, log=lambda *a: None).run()
    assert len(records) == 2 and all(r["ok"] and r["completion_tokens"] == 2 for r in records)
    # two requests of two 1 s chunks on one shared clock: 4 s, without the 2 x 5 s of making clients
    assert {r["unit_wall_s"] for r in records} == {4.0}


# ------------------------------------------------------------------ the plots


def test_speedup_vs_k_draws_one_line_per_draft_head_not_one_line_through_both(tmp_path, monkeypatch):
    """With --draft-vocab 0 16384 the fixed-k runs of both heads were one
    line per temperature, sorted by k: it went back and forth between the
    heads at every k."""
    from matplotlib.axes import Axes

    from specdec.bench import plots

    base = _stats(proposed_tokens=0, accepted_tokens=0, k={"histogram": [4]}, accepted_per_position=[], rounds=4,
                  draft_time_s=0.0, draft_compute_time_s=0.0)
    recs = [_record(TARGET_ONLY, SERVICE, "none", None, unit=0, wall=2.0, stats=base)]
    for name, k, wall in (("fixed-k2", 2, 1.0), ("fixed-k4", 4, 0.8), ("fixed-k2/v64", 2, 1.6),
                          ("fixed-k4/v64", 4, 1.2)):
        recs.append(dict(_record(name, SERVICE, "fixed", k, unit=len(recs), wall=wall, stats=_stats()),
                         draft_vocab=64 if "/v64" in name else 0))
    runs = build_runs(recs)
    lines = []
    real_plot = Axes.plot

    def plot(self, xs, ys, *args, **kwargs):
        lines.append((self.get_title(), list(xs), list(ys), kwargs.get("label")))
        return real_plot(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    assert "speedup_vs_k.png" in plots.write_plots(runs, tmp_path)
    measured = [(xs, ys, label) for _, xs, ys, label in lines if label and label.startswith("measured")]
    assert all(xs == sorted(set(xs)) for xs, _, _ in measured), measured  # each line: one point per k
    by_label = {label: ys for _, ys, label in measured}
    assert by_label["measured, T=0 (greedy)"] == pytest.approx([2.0, 2.5])
    assert by_label["measured, T=0 (greedy), v64"] == pytest.approx([2.0 / 1.6, 2.0 / 1.2])


# ------------------------------------------------------------------- identity


def test_identity_compares_the_served_outputs_each_cut_at_its_first_eos():
    """`specd identity` runs both paths for max_tokens forwards, but a request
    ends at its first EOS: a difference after an EOS both paths emitted at the
    same place is not in any output a client sees, and was counted as one."""
    from specdec.bench.identity import first_difference, served

    eos = frozenset({2, 9})
    rows = [torch.tensor([float(i), 0.0, 1.0]) for i in range(4)]
    other = [torch.tensor([float(i), 1.0, 0.0]) for i in range(4)]
    assert served([5, 6, 2, 7], eos) == [5, 6]
    # The same tokens through the EOS, different ones after it: identical as served.
    assert first_difference([5, 6, 2, 7], rows, [5, 6, 2, 8], other, eos) is None
    # Two different EOS ids at the same place end both outputs there alike.
    assert first_difference([5, 6, 2, 7], rows, [5, 6, 9, 8], other, eos) is None
    # One path ending where the other goes on is a difference, at that token.
    d = first_difference([5, 6, 2, 7], rows, [5, 6, 3, 2], other, eos)
    assert (d.position, d.target_only_token, d.speculative_token) == (2, 2, 3)
    # Before any EOS, as before: the first differing token.
    assert first_difference([5, 1, 2, 7], rows, [5, 6, 2, 7], other, eos).position == 1
    # Without EOS ids, the whole of both outputs.
    assert first_difference([5, 6, 2, 7], rows, [5, 6, 2, 8], other).position == 3


def test_identity_takes_the_targets_eos_ids_as_the_orchestrator_does():
    from specdec.bench.identity import eos_ids_of

    engine = types.SimpleNamespace(info=types.SimpleNamespace(eos_token_ids=(151643, 151645)),
                                   tokenizer=types.SimpleNamespace(eos_token_id=151643))
    assert eos_ids_of(engine) == {151643, 151645}
    no_tokenizer = types.SimpleNamespace(info=types.SimpleNamespace(eos_token_ids=(2,)), tokenizer=None)
    assert eos_ids_of(no_tokenizer) == {2}


def test_identitys_logit_difference_ignores_the_padding_rows_both_paths_mask():
    """The real pair's rows past the usable vocabulary are -inf in both paths:
    the printed maximum difference read "nan" at every difference."""
    import torch

    from specdec.bench.identity import max_abs_difference

    a = torch.tensor([17.375, 17.25, -float("inf"), -float("inf")])
    b = torch.tensor([17.375, 17.375, -float("inf"), -float("inf")])
    assert max_abs_difference(a, b) == 0.125
