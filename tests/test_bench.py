"""`specd bench`: configs, the interleaved schedule, aggregation, the report,
user errors, and one end-to-end run on a tiny random pair."""
from __future__ import annotations

import json
import os

import pytest

from specdec.bench import plots as bench_plots
from specdec.bench import report
from specdec.bench.aggregate import build_runs, evaluate_goals
from specdec.bench.runner import (
    HF,
    HF_ASSISTED,
    SERVICE,
    TARGET_ONLY,
    NetworkCondition,
    Plan,
    Prompt,
    Route,
    build_configs,
    mark_identity,
    network_conditions,
    routes,
    schedule,
    with_variants,
)
from specdec.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ------------------------------------------------------------ configs, plan


def test_build_configs_is_data_driven():
    configs = build_configs(["service", "hf", "hf-assisted"], [2, 4], ["fixed", "adaptive", "goodput-pipeline"])
    names = [c.name for c in configs]
    assert names == ["target-only", "hf", "hf-assisted", "fixed-k2", "fixed-k4", "adaptive", "goodput-pipeline"]
    by = {c.name: c for c in configs}
    assert by["target-only"].request_kwargs() == {"speculate": False}
    assert by["fixed-k4"].request_kwargs() == {"policy": "fixed", "pipeline": False, "num_draft_tokens": 4}
    assert by["goodput-pipeline"].request_kwargs() == {"policy": "goodput", "pipeline": True}
    assert [c.name for c in build_configs([], [3], ["fixed-pipeline"])] == ["fixed-k3-pipeline"]
    with pytest.raises(ValueError):
        build_configs([], [3], ["adaptive", "adaptive"])


def test_network_conditions():
    assert network_conditions(None, None, None) == [NetworkCondition("direct")]
    sweep = network_conditions([0, 10], None, None)
    assert [c.name for c in sweep] == ["rtt 0 ms", "rtt 10 ms"]
    assert sweep[1].one_way_delays_ms() == {"draft": 5.0, "target": 5.0} and sweep[0].proxied
    one = network_conditions(None, 4, 20, jitter_ms=1)
    assert len(one) == 1 and one[0].one_way_delays_ms() == {"draft": 2.0, "target": 10.0}


def _plan(**over) -> Plan:
    kw = dict(configs=build_configs(["service", "hf"], [2], ["fixed"]),
              prompts=[Prompt(i, "token-ids", (5, 6, 7), 100 + i) for i in range(3)],
              temperatures=[0.0], concurrency=[1, 2], repeats=2,
              conditions=[NetworkCondition("rtt 0 ms", 0, 0), NetworkCondition("rtt 10 ms", 10, 10)], max_tokens=4)
    kw.update(over)
    return Plan(**kw)


def test_schedule_interleaves_and_rotates():
    units = schedule(_plan())
    first = [u for u in units if u.condition == 0 and u.repeat == 0 and u.concurrency == 1]
    # per prompt, every config, the order rotated by repeat + prompt index
    assert [u.config.name for u in first[:3]] == ["target-only", "hf", "fixed-k2"]
    assert [u.config.name for u in first[3:6]] == ["hf", "fixed-k2", "target-only"]
    second = [u for u in units if u.condition == 0 and u.repeat == 1 and u.concurrency == 1]
    assert [u.config.name for u in second[:3]] == ["hf", "fixed-k2", "target-only"]
    # HF only at concurrency 1 and only under the first network condition
    assert {u.condition for u in units if u.config.kind == HF} == {0}
    assert all(u.concurrency == 1 for u in units if u.config.kind == HF)
    # waves: service configs, prompts cycled up to a multiple of c
    waves = [u for u in units if u.concurrency == 2]
    assert {u.config.name for u in waves} == {"target-only", "fixed-k2"}
    assert all(len(u.jobs) == 4 for u in waves)
    assert [u.id for u in units] == list(range(len(units)))
    restricted = schedule(_plan(concurrency_configs=["fixed-k2"]))
    assert {u.config.name for u in restricted if u.concurrency == 2} == {"fixed-k2"}


def test_variants_per_draft_head_and_batcher_setting():
    base = build_configs(["service", "hf-assisted"], [2], ["fixed", "goodput"])
    # one head, batcher on: today's names, every config on the one route
    same = with_variants(base, [16384], [True])
    assert [c.name for c in same] == [c.name for c in base]
    assert routes(same) == [Route(16384, True)] and not any(c.waves_only for c in same)
    # two heads: each specdec config once per head; target-only and HF once
    two = with_variants(base, [0, 16384], [True])
    assert [c.name for c in two] == ["target-only", "hf-assisted", "fixed-k2", "fixed-k2/v16384", "goodput",
                                     "goodput/v16384"]
    by = {c.name: c for c in two}
    assert by["fixed-k2/v16384"].route == Route(16384, True) and by["fixed-k2/v16384"].base == "fixed-k2"
    assert by["fixed-k2/v16384"].request_kwargs() == by["fixed-k2"].request_kwargs()
    assert by["target-only"].route == Route(0, True)
    assert routes(two) == [Route(0, True), Route(16384, True)]
    # batcher on and off: every service config also with it off, only in waves
    both = with_variants(base, [0, 16384], [False, True])
    off = [c for c in both if c.waves_only]
    assert [c.name for c in off] == ["target-only/batcher-off", "fixed-k2/batcher-off",
                                     "fixed-k2/v16384/batcher-off", "goodput/batcher-off", "goodput/v16384/batcher-off"]
    assert all(not c.batching for c in off) and all(c.batching for c in both if c.kind == "service" and not c.waves_only)
    assert set(routes(both)) == {Route(v, b) for v in (0, 16384) for b in (True, False)}
    # batcher off alone: no suffix, runs at every concurrency
    assert [c.name for c in with_variants(base, [0], [False])] == [c.name for c in base]
    for heads, batching in (([0, 0], [True]), ([0], [True, True]), ([], [True])):
        with pytest.raises(ValueError):
            with_variants(base, heads, batching)
    # speculation gate on and off: the specdec configs also with it off, only in waves; target-only once
    gated = with_variants(base, [0], [True], [True, False])
    assert [c.name for c in gated if c.waves_only] == ["fixed-k2/gate-off", "goodput/gate-off"]
    assert [c.name for c in gated if c.kind == "service" and not c.waves_only] == ["target-only", "fixed-k2",
                                                                                   "goodput"]
    assert routes(gated) == [Route(0, True, True), Route(0, True, False)]
    assert Route(0, True, False).name == "full-nogate"
    with pytest.raises(ValueError):
        with_variants(base, [0], [True], [True, True])


def test_variants_per_draft_min_confidence():
    from specdec.bench.configs import with_confidences

    base = build_configs(["service", "hf-assisted"], [2], ["fixed", "goodput"])
    assert with_confidences(base, []) == base  # the server's default: nothing sent
    one = with_confidences(base, [0.5])
    assert [c.name for c in one] == [c.name for c in base]
    by = {c.name: c for c in one}
    assert by["goodput"].request_kwargs()["draft_min_confidence"] == 0.5
    assert "draft_min_confidence" not in by["target-only"].request_kwargs()
    two = with_confidences(base, [0, 0.5])
    assert [c.name for c in two] == ["target-only", "hf-assisted", "fixed-k2/c0", "fixed-k2/c0.5", "goodput/c0",
                                     "goodput/c0.5"]
    assert {c.name: c for c in two}["fixed-k2/c0"].request_kwargs()["draft_min_confidence"] == 0
    for bad in ([0.5, 0.5], [1.5], [-0.1]):
        with pytest.raises(ValueError, match="draft-min-confidence"):
            with_confidences(base, bad)


def test_schedule_runs_batcher_off_variants_only_in_waves():
    configs = with_variants(build_configs(["service"], [2], ["fixed"]), [0, 64], [True, False])
    units = schedule(_plan(configs=configs, repeats=1, conditions=[NetworkCondition("direct")]))
    one = {u.config.name for u in units if u.concurrency == 1}
    waves = {u.config.name for u in units if u.concurrency == 2}
    assert one == {"target-only", "fixed-k2", "fixed-k2/v64"}
    assert waves == one | {"target-only/batcher-off", "fixed-k2/batcher-off", "fixed-k2/v64/batcher-off"}
    # --concurrency-configs by base name takes every head and batcher variant
    units = schedule(_plan(configs=configs, repeats=1, conditions=[NetworkCondition("direct")],
                           concurrency_configs=["fixed-k2"]))
    assert {u.config.name for u in units if u.concurrency == 2} == {"fixed-k2", "fixed-k2/v64", "fixed-k2/batcher-off",
                                                                  "fixed-k2/v64/batcher-off"}


def _bench_args(**over):
    """specd bench's parsed flags: a small tiny-pair run unless overridden."""
    import argparse

    kw = {"quick": False, "max_tokens": 8, "prompts": None, "chat_prompts": None, "token_prompts": 2,
          "token_prompt_len": 8, "num_draft_tokens": [2], "policies": ["fixed"], "baselines": ["service"],
          "temperatures": [0.0], "concurrency": [1, 2], "repeats": 1, "concurrency_configs": None, "threads": 1,
          "rtt_ms": None, "draft_rtt_ms": None, "target_rtt_ms": None, "jitter_ms": 0.0, "device": "cpu",
          "draft_device": None, "target_device": None, "pair": "tiny", "draft": None, "target": None,
          "draft_vocab": [0], "batcher": ["on"], "speculation_gate": ["on"], "draft_min_confidence": []}
    kw.update(over)
    return argparse.Namespace(**kw)


def test_draft_vocab_and_batcher_flags_are_checked():
    from specdec.cli.bench_options import UsageError, resolve

    args = _bench_args

    o = resolve(args(draft_vocab=[0, 64], batcher=["on", "off"], concurrency_configs=["fixed-k2/v64"]))
    assert o["draft_vocabs"] == [0, 64] and o["batching"] == [True, False]
    assert "fixed-k2/v64/batcher-off" in [c.name for c in o["configs"]]
    for bad, match in (({"draft_vocab": [-1]}, ">= 0"), ({"draft_vocab": [64, 64]}, "twice"),
                       ({"batcher": ["off", "off"]}, "twice"),
                       ({"batcher": ["on", "off"], "concurrency": [1]}, "concurrency"),
                       ({"speculation_gate": ["on", "on"]}, "twice"),
                       ({"speculation_gate": ["on", "off"], "concurrency": [1]}, "concurrency"),
                       ({"concurrency_configs": ["fixed-k2/v64"]}, "no service config"),
                       ({"draft_vocab": [0, 64], "policies": ["none"]}, "--policies"),
                       ({"draft_quantize": "int8", "draft_device": "cuda"}, "CPU only"),
                       ({"draft_min_confidence": [0.5, 2.0]}, r"\[0, 1\]")):
        with pytest.raises(UsageError, match=match):
            resolve(args(**bad))


def test_a_pair_whose_weights_cannot_fit_is_refused_before_anything_loads(monkeypatch):
    """synth 0.5B + 7B on a CPU: the 7B's bf16 weights in its service and again in the bench's
    HF baselines, 14.2 GiB each, against what the machine has free (faked here), named part by part."""
    from specdec.cli.bench_options import UsageError, resolve
    from specdec.engine import loading

    monkeypatch.setattr(loading, "free_device_memory", lambda device: 20 * 2**30)
    many = dict(pair="synth-0.5b-7b", baselines=["service", "hf"], concurrency=[1], dtype="bfloat16")
    with pytest.raises(UsageError, match=r"need 29\.3 GiB on cpu \(target \(service\) 14\.2, target \(HF baselines\) "
                                         r"14\.2, draft \(service\) 0\.9\) and 20\.0 GiB is free there"):
        resolve(_bench_args(**many))
    # Without the HF baselines the 7B loads once: 15.1 GiB fits in 20.
    assert resolve(_bench_args(**dict(many, baselines=["service"])))["target_dir"] == "synth:qwen2.5-7b"


def test_hf_assisted_runs_for_a_pair_whose_rows_differ_and_the_notes_say_how(monkeypatch):
    """transformers refuses assisted generation when the rows differ (it takes
    that for differing tokenizers); bench/hf_baselines.py matches the draft's
    rows to the target's (tests/test_hf_assisted_rows.py), and the run's
    notes say so."""
    from specdec.cli.bench_options import resolve
    from specdec.engine import loading

    monkeypatch.setattr(loading, "free_device_memory", lambda device: 64 * 2**30)
    o = resolve(_bench_args(pair="synth-0.5b-7b", baselines=None, concurrency=[1]))
    assert "hf-assisted" in o["baselines"] and "hf-assisted" in {c.name for c in o["configs"]}
    assert o["notes"] == ["hf-assisted: the draft's 151936 vocabulary rows were matched to the target's 152064 for "
                          "transformers' assisted generation, which takes differing rows for differing tokenizers; "
                          "the draft proposes what it would (no id past its own rows, none past the target's)"]
    from specdec.cli.bench_results import run_notes

    assert run_notes(o, [])[0] == o["notes"][0]  # summary.md's Notes say it too, not only the console
    assert resolve(_bench_args(concurrency=[1]))["notes"] == []


# ------------------------------------------------------- records and runs


def _record(config, kind, policy, k, *, unit, prompt=0, temp=0.0, conc=1, network="direct", tokens=(1, 2, 3, 4),
            wall=1.0, stats=None, repeat=0):
    return {"unit": unit, "config": config, "kind": kind, "policy": policy, "k": k, "pipeline": False,
            "temperature": temp, "concurrency": conc, "network": network, "draft_rtt_ms": None,
            "target_rtt_ms": None, "jitter_ms": 0.0, "repeat": repeat, "prompt_index": prompt,
            "prompt_kind": "token-ids", "prompt_tokens": 3, "seed": 1, "max_tokens": 4, "ok": True, "error": None,
            "error_code": None, "completion_tokens": len(tokens), "wall_s": wall, "ttft_s": 0.25,
            "tokens_per_s": len(tokens) / wall, "finish_reason": "length", "token_ids": list(tokens),
            "arrivals": [[0.25, 1], [0.5, 1], [0.75, 2]], "stats": stats, "unit_requests": 1, "unit_wall_s": wall,
            "unit_proxy_bytes": None, "peak_mb": {"target": 100.0, "draft": 50.0, "orchestrator": 30.0}
            if kind == SERVICE else {"bench": 400.0}, "gpu_mb": None, "identical_to_target_only": None}


def _stats(**over):
    s = {"completion_tokens": 4, "prompt_tokens": 3, "rounds": 2, "proposed_tokens": 4, "accepted_tokens": 2,
         "k": {"histogram": [0, 0, 2]}, "accepted_per_position": [1, 1], "fallback_rounds": 0,
         "draft_time_s": 0.2, "verify_time_s": 0.3, "target_compute_time_s": 0.2, "draft_compute_time_s": 0.1,
         "wire_bytes": 400, "round_trips": 6, "pipelined_rounds": 0, "duration_s": 0.6,
         "time_to_first_token_s": 0.2, "finish_reason": "length"}
    s.update(over)
    return s


def _records():
    base = _stats(proposed_tokens=0, accepted_tokens=0, k={"histogram": [4]}, accepted_per_position=[], rounds=4,
                  draft_time_s=0.0, draft_compute_time_s=0.0)
    recs = []
    for temp in (0.0, 0.7):
        recs += [
            _record(TARGET_ONLY, SERVICE, "none", None, unit=len(recs), temp=temp, wall=2.0, stats=base),
            _record("hf-assisted", HF_ASSISTED, None, None, unit=len(recs) + 1, temp=temp, wall=1.6),
            _record("fixed-k2", SERVICE, "fixed", 2, unit=len(recs) + 2, temp=temp, wall=1.0, stats=_stats()),
            _record("fixed-k2", SERVICE, "fixed", 2, unit=len(recs) + 3, temp=temp, wall=1.0, conc=4,
                    stats=_stats(), tokens=(1, 2, 3, 9)),
            _record(TARGET_ONLY, SERVICE, "none", None, unit=len(recs) + 4, temp=temp, wall=2.0, conc=4, stats=base),
        ]
    return recs


def test_mark_identity_against_target_only_at_concurrency_one():
    recs = _records()
    mark_identity(recs)
    greedy = {(r["config"], r["concurrency"]): r["identical_to_target_only"] for r in recs if r["temperature"] == 0}
    assert greedy == {(TARGET_ONLY, 1): True, ("hf-assisted", 1): True, ("fixed-k2", 1): True,
                      ("fixed-k2", 4): False, (TARGET_ONLY, 4): True}


def test_build_runs_speedups_bound_and_goals():
    recs = _records()
    mark_identity(recs)
    runs = build_runs(recs, {"machine": {"cpu": "test"}})
    by = {(r["config"], r["temperature"], r["concurrency"]): r for r in runs}
    spec = by[("fixed-k2", 0.0, 1)]
    assert spec["tokens_per_s"] == 4.0 and spec["speedup_vs_target_only"] == 2.0
    assert spec["speedup_vs_hf_assisted"] == pytest.approx(1.6)
    assert spec["acceptance_rate"] == 0.5 and spec["tokens_per_round"] == 2.0
    assert spec["acceptance_per_position"] == [0.5, 0.5]
    # samples: 0.25 (one token), 0.125 x 2 (two tokens 0.25 s later)
    assert spec["itl_p50_s"] == pytest.approx(0.125) and spec["itl_p95_s"] == pytest.approx(0.2375)
    assert spec["ttft_s"] == 0.25
    assert spec["alpha_hat"] == pytest.approx(2 / 3)  # 2 accepted, 1 round with a rejection
    assert spec["efficiency"] == pytest.approx(spec["speedup_vs_target_only"] / spec["expected_speedup"])
    assert spec["wire_bytes_per_token"] == 100 and spec["round_trips_per_token"] == 1.5
    assert spec["identical_to_target_only"] == {"identical": 1, "compared": 1}
    assert spec["machine"] == {"cpu": "test"}
    assert by[("fixed-k2", 0.0, 4)]["bound"] is None  # the bound is for one stream
    goals = evaluate_goals(runs)
    first = {g["goal"]: g for g in goals if g["temperature"] == 0}
    assert first["specdec best vs target-only (service)"]["met"] is True
    assert first["specdec best vs HF assisted"]["met"] is True
    assert first["8-stream aggregate vs one stream"]["met"] is None  # 4 streams measured, not 8


def test_report_markdown_jsonl_and_plots(tmp_path):
    recs = _records()
    mark_identity(recs)
    runs = build_runs(recs)
    report.write_jsonl(tmp_path / "runs.jsonl", runs)
    assert report.read_jsonl(tmp_path / "runs.jsonl") == json.loads(json.dumps(runs))
    plots = bench_plots.write_plots(runs, tmp_path)
    assert set(plots) >= {"speedup_vs_k.png", "acceptance_per_position.png", "tokens_per_s_vs_concurrency.png"}
    for name in plots:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    meta = {"machine": {"cpu": "Test CPU", "usable_cores": 2, "cores": 2, "gpus": []}, "command": "specd bench --x",
            "settings": {"max tokens": 4}, "plots": plots}
    md = report.summary_markdown(runs, meta=meta)
    assert "Test CPU" in md and "specd bench --x" in md
    assert "## T=0 (greedy), one stream" in md and "## T=0.7 (sampled), one stream" in md
    assert "## Concurrency (aggregate tok/s)" in md and "## Goals" in md and "## Analytic bound" in md
    row = next(line for line in md.splitlines() if line.startswith("| fixed-k2 | 4.00 |"))
    assert "| 2.00x | 1.60x |" in row and "| 1/1 |" in row and "100 / 50 / 30" in row
    assert "| specdec best vs target-only (service) | T=0 (greedy) | >= 2.0 | 2.00 | fixed-k2 | met |" in md


# -------------------------------------------------------------- user errors


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["bench", "--draft", "no-such-model", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-model" in err[0] and err[0].startswith("specd bench: error:")
    assert main(["bench", "--pair", "tiny", "--rtt-ms", "1", "--draft-rtt-ms", "2", "--out", str(tmp_path / "b")]) == 2
    assert "--rtt-ms" in capsys.readouterr().err
    assert main(["bench", "--pair", "tiny", "--num-draft-tokens", "0", "--out", str(tmp_path / "c")]) == 2
    assert main(["bench", "--pair", "synth-0.5b-7b", "--draft", "x", "--out", str(tmp_path / "d")]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--baselines", "nope"])
    assert exc.value.code == 2


# --------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_pair_dirs(tmp_path_factory):
    from specdec.engine.draft_vocab import save_ranking
    from tests.conftest import tiny_model

    root = tmp_path_factory.mktemp("bench-pair")
    tiny_model("llama", seed=3, init_range=0.2).save_pretrained(root / "target")
    draft = tiny_model("llama", seed=3, init_range=0.2, layers=1)
    draft.save_pretrained(root / "draft")
    vocab = draft.config.vocab_size  # a ranking for --draft-vocab (no tokenizer: its fingerprint is the size)
    save_ranking(root / "draft", list(range(vocab))[::-1], f"untokenized-vocab-{vocab}", "test", vocab)
    return str(root / "draft"), str(root / "target")


def _children_serving() -> list[int]:
    """Our child processes that are specd services."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"serve" in cmd:
            found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)  # 74 s alone on the 2-core VM, 90 s beside another test file (xdist)
def test_bench_end_to_end_on_a_tiny_pair(tiny_pair_dirs, tmp_path, capsys):
    draft, target = tiny_pair_dirs
    out = tmp_path / "out"
    try:
        import specdec.latency_proxy  # noqa: F401
        network = ["--rtt-ms", "0", "4"]
    except ImportError:
        network = []
    rc = main(["bench", "--draft", draft, "--target", target, "--dtype", "float32", "--threads", "1",
               "--token-prompts", "2", "--token-prompt-len", "8", "--max-tokens", "8", "--num-draft-tokens", "2", "3",
               "--policies", "fixed", "adaptive", "--temperatures", "0", "0.7", "--concurrency", "1", "2",
               "--repeats", "1", "--draft-vocab", "0", "64", "--batcher", "on", "off",
               "--speculation-gate", "on", "off",
               "--concurrency-configs", "target-only", "fixed-k2", *network, "--out", str(out),
               "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "## Goals" in printed and str(out) in printed

    runs = report.read_jsonl(out / "runs.jsonl")
    keys = {(r["config"], r["temperature"], r["concurrency"], r["network"]) for r in runs}
    nets = ["rtt 0 ms", "rtt 4 ms"] if network else ["direct"]
    # each specdec config on both draft heads; the configs that run in waves also with the batcher off, and
    # the specdec ones with the speculation gate off, only there
    service = ["target-only", "fixed-k2", "fixed-k3", "adaptive", "fixed-k2/v64", "fixed-k3/v64", "adaptive/v64"]
    waves = ["target-only", "fixed-k2", "fixed-k2/v64"]
    expected = {(c, t, 1, net) for c in service for t in (0.0, 0.7) for net in nets}
    expected |= {(c + off + gate, t, 2, net) for c in waves for off in ("", "/batcher-off")
                 for gate in (("", "/gate-off") if c != "target-only" else ("",)) for t in (0.0, 0.7) for net in nets}
    expected |= {(c, t, 1, nets[0]) for c in ("hf", "hf-assisted") for t in (0.0, 0.7)}
    assert keys == expected
    heads = {r["config"]: (r["draft_vocab"], r["batching"], r["gate"]) for r in runs}
    assert heads["fixed-k2"] == (0, True, True) and heads["fixed-k2/v64/batcher-off"] == (64, False, True)
    assert heads["fixed-k2/v64/batcher-off/gate-off"] == (64, False, False)
    assert heads["target-only"] == (None, True, None) and heads["hf"] == (None, None, None)
    assert all(r["errors"] == 0 for r in runs)
    assert all(r["machine"]["cores"] and r["models"]["target"] == target for r in runs)
    # what else the machine ran meanwhile, where /proc tells it
    assert all(r["machine"]["other_load"].startswith("Other work on this machine") for r in runs) or \
        not os.path.exists("/proc/stat")
    by = {(r["config"], r["temperature"], r["concurrency"], r["network"]): r for r in runs}
    for c in service:  # greedy specdec equals target-only, token for token
        ident = by[(c, 0.0, 1, nets[0])]["identical_to_target_only"]
        assert ident["compared"] == 2 and ident["identical"] == 2, c
    fixed = by[("fixed-k2", 0.0, 1, nets[0])]
    # The bound drafts k = 2 a round, or the mean the rounds drafted when they mostly stopped early.
    assert fixed["acceptance_rate"] is not None
    assert fixed["bound"]["k"] == (2 if fixed["mean_k"] >= 0.9 * 2 else pytest.approx(fixed["mean_k"]))
    assert fixed["peak_mb"]["target"] > 0 and fixed["wire_bytes_per_token"] > 0
    assert by[("hf", 0.0, 1, nets[0])]["peak_mb"]["bench"] > 0
    requests = report.read_jsonl(out / "requests.jsonl")
    assert len(requests) == sum(r["requests"] for r in runs)

    summary = (out / "summary.md").read_text()
    for heading in ("## Machine", "## Command", "## Goals", "## T=0 (greedy), one stream",
                    "## T=0.7 (sampled), one stream", "## Concurrency (aggregate tok/s)", "## Analytic bound",
                    "## Projected speedup (greedy, draft head full)", "## Projected speedup (T = 0.7, draft head v64)"):
        assert heading in summary
    assert "float32 (auto: " in summary  # the draft's weights as --draft-quantize auto chose them, and why
    assert summary.count("(projected) |") == 2 * 2 * 3 * 2  # 2 heads x 2 temperatures x 3 acceptances x 2 layouts
    pngs = ["speedup_vs_k.png", "acceptance_per_position.png", "tokens_per_s_vs_concurrency.png",
            "projected_speedup.png", "tokens_per_s_per_config.png"]
    if network:
        assert "## Network" in summary
        pngs.append("tokens_per_s_vs_rtt.png")
    for name in pngs:
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name

    assert "| c=2 / c=1 | c=2 vs target-only | c=2 batcher off | batcher on / off | c=2 gate off | gate on / off |" \
        in summary
    assert "## Projected speedup (greedy, draft head v64)" in summary

    services = json.loads((out / "services.json").read_text())
    by_role = {s["role"]: s["command"] for s in services}
    routes = [f"orchestrator-{head}{batch}{gate}" for head in ("full", "v64") for batch in ("", "-nobatch")
              for gate in ("", "-nogate")]
    assert set(by_role) == {"target", "draft", "draft-v64", "orchestrator", *routes[1:]}
    assert "--draft-vocab" not in by_role["draft"] and by_role["draft-v64"][-4:-2] == ["--draft-vocab", "64"]
    assert by_role["draft"][-2:] == ["--quantize", "none"]  # auto, resolved as the service would for tiny drafts
    assert sorted(r for r, cmd in by_role.items() if "--no-batching" in cmd) == sorted(r for r in routes
                                                                                       if "nobatch" in r)
    assert sorted(r for r, cmd in by_role.items() if "--no-speculation-gate" in cmd) == sorted(r for r in routes
                                                                                               if "nogate" in r)
    for s in services:
        assert not os.path.exists(f"/proc/{s['pid']}"), f"{s['role']} still running"
    assert _children_serving() == []


def test_bench_on_a_synthetic_pair_projects_speedups(tmp_path, capsys):
    """--pair synth-tiny: the services build random-weight models in place;
    the summary projects speedups at the assumed acceptances."""
    out = tmp_path / "out"
    rc = main(["bench", "--pair", "synth-tiny", "--dtype", "float32", "--threads", "1", "--max-tokens", "8",
               "--token-prompts", "1", "--num-draft-tokens", "2", "--policies", "fixed", "--baselines", "service",
               "--temperatures", "0", "--concurrency", "1", "--repeats", "1", "--assume-acceptance", "0.6", "0.9",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = (out / "summary.md").read_text()
    assert "synth:tiny" in summary and "## Projected speedup (greedy)" in summary
    assert "| 0.6 | one-gpu | 2 |" in summary and "| 0.9 | two-gpus-pipelined | 2 |" in summary
    assert (out / "projected_speedup.png").read_bytes().startswith(PNG_MAGIC)


def test_draft_quantize_auto_is_resolved_once_for_the_run_or_left_to_each_loader(monkeypatch):
    """--draft-quantize auto: resolved from the draft's config for the services and HF assisted alike;
    a draft without a config to read here (a .gguf) leaves it to each loader; an unknown synth name is
    a usage error, not a traceback."""
    from specdec.cli import bench_options
    from specdec.engine import quantize
    from specdec.models import skeleton

    monkeypatch.setattr(quantize, "_cpu_has_vnni", lambda: True)
    o = {"draft_dir": "synth:qwen2.5-0.5b", "draft_quantize_setting": "auto", "draft_device": "cpu"}
    bench_options._choose_draft_weights(o)
    assert (o["draft_quantize"], o["draft_quantize_why"]) == ("int8", "auto: a CPU with VNNI, hidden size 896")
    tiny = dict(o, draft_dir="synth:tiny")  # hidden 64: its dtype
    bench_options._choose_draft_weights(tiny)
    assert tiny["draft_quantize"] == "none" and "below 512" in tiny["draft_quantize_why"]
    with pytest.raises(bench_options.UsageError):
        bench_options._choose_draft_weights(dict(o, draft_dir="synth:no-such-model"))
    monkeypatch.setattr(skeleton, "model_config", lambda model: None)
    gguf = dict(o, draft_dir="/models/draft.gguf")
    bench_options._choose_draft_weights(gguf)
    assert gguf["draft_quantize"] == "auto"
    pinned = dict(gguf, draft_quantize_setting="none")
    bench_options._choose_draft_weights(pinned)
    assert pinned["draft_quantize"] == "none"
