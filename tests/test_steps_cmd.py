"""`specd steps`: the command writes its table, JSON lines and plot; with
--lifecycle also the load, prefill, rollback and batched-forward figures."""
from __future__ import annotations

import json

from specdec.cli.main import main
from specdec.engine.loading import resolve_dtype


def test_specd_steps_on_a_synthetic_model(tmp_path, capsys):
    out = tmp_path / "steps"
    rc = main(["steps", "synth:tiny", "--num-draft-tokens", "2", "--batches", "1", "2", "--repeat", "2",
               "--context", "16", "--out", str(out), "--lifecycle", "--rollback-contexts", "16", "256"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert {r["shape"] for r in rows} == {"decode 1x1", "verify 1x3", "decode 2x1", "verify 2x3"}
    assert all(r["ms"] > 0 and r["over_floor"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "copy bandwidth" in printed and (out / "steps.png").stat().st_size > 1000
    [life] = [json.loads(line) for line in (out / "lifecycle.jsonl").read_text().splitlines()]
    assert life["model"] == "synth:tiny" and life["load_s"] > 0 and life["prefill_tokens"] == 16
    assert life["prefill_s"] > 0 and life["kv_bytes_per_token"] > 0
    assert set(life["rollback_us"]) == {"16", "256"} and all(v > 0 for v in life["rollback_us"].values())
    assert [(b["sessions"], b["tokens_per_session"]) for b in life["batches"]] == [(1, 3), (2, 3)]
    assert all(b["batched_ms"] > 0 and b["one_by_one_ms"] > 0 for b in life["batches"])
    # auto: bf16 where the CPU computes it natively, float32 elsewhere (an AVX2-only CPU)
    dtype = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    assert f"| synth:tiny | {dtype} |" in printed and "rollback @256 µs" in printed


def test_specd_steps_refuses_an_unknown_model(tmp_path):
    assert main(["steps", "no-such-model", "--out", str(tmp_path)]) == 1


def test_specd_steps_lifecycle_refuses_a_rollback_context_too_short(tmp_path, capsys):
    assert main(["steps", "synth:tiny", "--lifecycle", "--rollback-contexts", "8", "64", "--out", str(tmp_path)]) == 1
    assert "--rollback-contexts must be at least 16" in capsys.readouterr().err
