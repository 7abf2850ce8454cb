"""kill -9 one role of `specd up` in the middle of a greedy request, and check
that the request completes with the same tokens and `specd up` restarts the role.

    PYTHONPATH=. python benchmarks/kill_roles.py [--role draft|target] [--tokens 600]

Runs `specd up` on the tiny random pair (`specdec.bench.tiny_pair`, built into
a temporary cache), on ports 56151-56153 (metrics 56161-56163). Prints one JSON
line per role killed: completed, identical, recoveries/fallback rounds, the
sessions left open on each service once the request has ended, and whether the
role came back. Stops `specd up` (by its PID) at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from orchestrator.client import Client
from specdec.bench.tiny_pair import ensure_tiny_pair, tiny_prompts
from specdec.processes import wait_serving

PORT, METRICS = 56151, 56161


def children_by_role(pid: int) -> dict[str, int]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    roles = {}
    for line in out.splitlines():
        child, args = line.strip().split(" ", 1)
        for role in ("draft", "target", "orchestrator"):
            if f"serve {role}" in args:
                roles[role] = int(child)
    return roles


def sessions(offset: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS + offset}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specdec_active_sessions"))


def kill_mid_request(up: subprocess.Popen, client: Client, role: str, prompt: list[int], ref: list[int]) -> dict:
    victim = children_by_role(up.pid)[role]
    tokens, stats, start = [], None, time.monotonic()
    for i, reply in enumerate(client.stub.Generate(_request(prompt, len(ref)), timeout=120)):
        if reply.HasField("stats"):
            stats = reply.stats
            break
        tokens.extend(reply.chunk.token_ids)
        if i == 3:
            os.kill(victim, signal.SIGKILL)
    took = time.monotonic() - start
    deadline = time.monotonic() + 60
    back = None
    while time.monotonic() < deadline:
        back = children_by_role(up.pid).get(role)
        if back and back != victim:
            break
        time.sleep(0.5)
    port = {"draft": PORT + 1, "target": PORT + 2}[role]
    wait_serving(port, [up], 120)
    time.sleep(1.0)  # closes run in the background
    return {"killed": role, "completed": len(tokens) == len(ref), "identical": tokens == ref,
            "first_difference": next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None),
            "target_recoveries": stats.target_recoveries, "fallback_rounds": stats.fallback_rounds,
            "seconds": round(took, 2), "restarted": bool(back and back != victim), "up_running": up.poll() is None,
            "sessions_after": {"draft": sessions(1), "target": sessions(2)}}


def _request(prompt, n):
    from orchestrator.client import build_request

    return build_request(prompt, max_tokens=n, temperature=0, num_draft_tokens=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", action="append", choices=("draft", "target"))
    parser.add_argument("--tokens", type=int, default=600)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="specd-kill-")
    draft_dir, target_dir = ensure_tiny_pair(cache)
    up = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "up", "--draft-model", str(draft_dir),
                           "--target-model", str(target_dir), "--port", str(PORT), "--draft-port", str(PORT + 1),
                           "--target-port", str(PORT + 2), "--metrics-port", str(METRICS), "--threads", "1",
                           "--restart-backoff-s", "0.5"], start_new_session=True)
    try:
        wait_serving(PORT, [up], 300)
        prompt = tiny_prompts(1)[0]
        with Client(f"127.0.0.1:{PORT}", timeout_s=120) as client:
            # The reference: the same speculative request without a fault.
            ref = client.complete(prompt, max_tokens=args.tokens, temperature=0, num_draft_tokens=4).token_ids
            plain = client.complete(prompt, max_tokens=args.tokens, temperature=0, speculate=False).token_ids
            print(json.dumps({"reference_equals_target_only": ref == plain,
                              "first_difference": next((i for i, (a, b) in enumerate(zip(ref, plain)) if a != b),
                                                       None)}), flush=True)
            for role in args.role or ["draft", "target"]:
                print(json.dumps(kill_mid_request(up, client, role, prompt, ref)), flush=True)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


if __name__ == "__main__":
    main()
