"""specdec/bench/step_costs.py: step costs against the bandwidth floor."""
from __future__ import annotations

from specdec.bench.step_costs import copy_bandwidth, markdown, measure, plot, weight_bytes
from tests.conftest import tiny_engine


def test_step_costs_cover_every_shape_and_path(tmp_path):
    engine = tiny_engine("qwen2", max_context=256)
    engine.use_static_steps(48)
    costs = measure(engine, ks=(2, 4), batches=(1, 3), context=40, repeat=2, bandwidth=1e9)
    shapes = {(c.path, c.shape) for c in costs}
    assert shapes == {(p, s) for p in ("static", "eager")
                      for s in ("decode 1x1", "verify 1x3", "verify 1x5", "decode 3x1", "verify 3x3", "verify 3x5")}
    floor = weight_bytes(engine.model) / 1e9 * 1000
    assert all(c.ms > 0 and abs(c.floor_ms - floor) < 1e-9 and c.over_floor == c.ms / floor for c in costs)
    assert engine.num_sessions == 0 and engine.steps is not None  # sessions closed, steps restored
    assert markdown(costs).count("\n") == len(costs) + 1
    plot(costs, tmp_path / "steps.png")
    assert (tmp_path / "steps.png").stat().st_size > 1000


def test_copy_bandwidth_is_positive():
    import torch
    assert copy_bandwidth(torch.device("cpu"), megabytes=8, repeat=2) > 1e8


def test_propose_costs_time_both_ways_per_drafted_token_and_leave_nothing_open():
    from specdec.bench import propose_costs

    # Sized as `specd steps` sizes it, for its largest batch: the greedy and the sampled sessions
    # take turns (on a GPU's KV store, 8 slots for --batches 1 8, both sets at once did not fit).
    engine = tiny_engine("llama", max_context=256, max_sessions=3)
    costs = propose_costs.measure(engine, ks=(2, 5), batches=(1, 3), context=40, repeat=2, bandwidth=1e9)
    assert [(c.path, c.shape) for c in costs] == [(label, f"propose {b}x{k}") for b in (1, 3) for k in (2, 5)
                                                  for *_, label in propose_costs.MODES]
    assert {"propose, run ahead, T = 0.7", "propose, run ahead, T = 0.7, eager picks",
            "propose, run ahead, every other session T = 0.7"} <= {c.path for c in costs}
    assert all(c.ms > 0 and c.tokens_per_session == int(c.shape[-1]) for c in costs)
    assert engine.num_sessions == 0
    assert "per drafted token" in markdown(costs)
