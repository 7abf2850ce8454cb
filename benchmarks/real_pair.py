"""Issue-4 figures: the orchestrator on the default real pair, greedy.

    python benchmarks/real_pair.py --prompts 10 --max-tokens 128 [--num-draft-tokens 2 3 4 5 6] [--concurrency 1 4 8]

Starts the target and the draft as separate processes (as `specd up` does),
then, per configuration, one orchestrator process; runs HumanEval prompts
through `specd`'s Python client; reports acceptance, tokens per round and
tokens/s, checks every speculative output against target-only decoding
through the same target service, and measures aggregate throughput under
concurrency with and without the verify batcher. Prints Markdown; with
--json also writes one JSON line per run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import time

from orchestrator.client import Client
from specdec.bench.prompts import humaneval_prompts
from specdec.models.catalog import DEFAULT_PAIR
from specdec.processes import wait_serving


def spawn(args: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "specdec.cli.main", *args], stdout=log, stderr=log,
                            start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


class Orchestrator:
    def __init__(self, port: int, draft_port: int, target_port: int, batching: bool, tokenizer: str):
        self.port = port
        self.proc = spawn(["serve", "orchestrator", "--port", str(port), "--draft", f"127.0.0.1:{draft_port}",
                           "--target", f"127.0.0.1:{target_port}", "--tokenizer", tokenizer,
                           "--batching" if batching else "--no-batching"], f"/tmp/bench-orch-{port}.log")
        wait_serving(port, [self.proc], 120)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        stop(self.proc)


def run_one(port: int, prompt: str, max_tokens: int, **kwargs):
    with Client(f"127.0.0.1:{port}", timeout_s=3600) as client:
        start = time.perf_counter()
        result = client.complete(prompt, max_tokens=max_tokens, temperature=0, **kwargs)
        return result, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, nargs="*", default=[2, 3, 4, 5, 6])
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--concurrency-num-draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default=DEFAULT_PAIR.draft)
    ap.add_argument("--target", default=DEFAULT_PAIR.target)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    prompts = humaneval_prompts(args.prompts)
    common = ["--threads", str(args.threads), "--dtype", "auto", "--max-context", "2048"]
    target = spawn(["serve", "target", "--model", args.target, "--port", "50063", *common], "/tmp/bench-target.log")
    draft = spawn(["serve", "draft", "--model", args.draft, "--port", "50062", *common], "/tmp/bench-draft.log")
    runs = []
    try:
        wait_serving(50063, [target], 900)
        wait_serving(50062, [draft], 900)
        with Orchestrator(50061, 50062, 50063, True, args.target) as orch:
            configs = [("target-only", dict(speculate=False))]
            configs += [(f"fixed k={k}", dict(policy="fixed", num_draft_tokens=k)) for k in args.num_draft_tokens]
            if args.adaptive:
                configs.append(("adaptive", dict(policy="adaptive", num_draft_tokens=4)))
            reference: list[list[int]] = []
            for name, kwargs in configs:
                results = [run_one(orch.port, p, args.max_tokens, **kwargs) for p in prompts]
                tokens = [r.token_ids for r, _ in results]
                if name == "target-only":
                    reference = tokens
                identical = sum(t == ref for t, ref in zip(tokens, reference))
                stats = [r.stats for r, _ in results]
                total_tokens = sum(s.completion_tokens for s in stats)
                total_time = sum(t for _, t in results)
                proposed = sum(s.proposed_tokens for s in stats)
                run = dict(config=name, prompts=len(prompts), tokens=total_tokens,
                           tokens_per_s=total_tokens / total_time,
                           acceptance=sum(s.accepted_tokens for s in stats) / proposed if proposed else None,
                           tokens_per_round=total_tokens / sum(s.rounds for s in stats),
                           ttft_s=statistics.median(s.time_to_first_token_s for s in stats),
                           identical_to_target_only=f"{identical}/{len(prompts)}",
                           draft_s=sum(s.draft_time_s for s in stats), verify_s=sum(s.verify_time_s for s in stats),
                           wire_bytes_per_token=sum(s.wire_bytes for s in stats) / total_tokens)
                runs.append(run)
                print(json.dumps(run), flush=True)
        for batching in (True, False):
            with Orchestrator(50061, 50062, 50063, batching, args.target) as orch:
                for c in args.concurrency:
                    work = [prompts[i % len(prompts)] for i in range(c)]
                    start = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(c) as pool:
                        results = list(pool.map(lambda p: run_one(orch.port, p, args.max_tokens, policy="fixed",
                                                                  num_draft_tokens=args.concurrency_num_draft_tokens), work))
                    wall = time.perf_counter() - start
                    total = sum(r.stats.completion_tokens for r, _ in results)
                    run = dict(config=f"concurrency {c}, batcher {'on' if batching else 'off'}, k={args.concurrency_num_draft_tokens}",
                               aggregate_tokens_per_s=total / wall, tokens=total, wall_s=wall)
                    runs.append(run)
                    print(json.dumps(run), flush=True)
    finally:
        stop(draft)
        stop(target)
    if args.json:
        with open(args.json, "w") as f:
            for r in runs:
                f.write(json.dumps(r) + "\n")
    print("\n| configuration | tokens/s | acceptance | tokens/round | TTFT s | identical to target-only | wire B/token |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        if "tokens_per_s" in r:
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            print(f"| {r['config']} | {r['tokens_per_s']:.2f} | {acc} | {r['tokens_per_round']:.2f} | "
                  f"{r['ttft_s']:.2f} | {r['identical_to_target_only']} | {r['wire_bytes_per_token']:.0f} |")
    print("\n| concurrency | aggregate tokens/s |\n|---|---|")
    for r in runs:
        if "aggregate_tokens_per_s" in r:
            print(f"| {r['config']} | {r['aggregate_tokens_per_s']:.2f} |")


if __name__ == "__main__":
    main()
