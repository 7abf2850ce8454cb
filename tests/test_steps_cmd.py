"""`specd steps`: the command writes its table, JSON lines and plot."""
from __future__ import annotations

import json

from specdec.cli.main import main


def test_specd_steps_on_a_synthetic_model(tmp_path, capsys):
    out = tmp_path / "steps"
    rc = main(["steps", "synth:tiny", "--num-draft-tokens", "2", "--batches", "1", "2", "--repeat", "2",
               "--context", "16", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert {r["shape"] for r in rows} == {"decode 1x1", "verify 1x3", "decode 2x1", "verify 2x3"}
    assert all(r["ms"] > 0 and r["over_floor"] > 0 for r in rows)
    assert "copy bandwidth" in capsys.readouterr().out and (out / "steps.png").stat().st_size > 1000


def test_specd_steps_refuses_an_unknown_model(tmp_path):
    assert main(["steps", "no-such-model", "--out", str(tmp_path)]) == 1
