"""Does a seeded sampled request keep its *tokens* through a draft failure?
(Its distribution is kept: tests/test_draft_failure_sampling.py.)

    PYTHONPATH=. python benchmarks/draft_failure_tokens.py [--requests 100] [--tokens 64] [--fail-at 3]

In-process services on the tiny random pair (`specdec.bench.tiny_pair`):
each seed is run twice, once without a fault and once with the draft failing
(UNAVAILABLE, as a dead draft answers) from its `--fail-at`-th Propose on,
so the rest of the request runs target-only. Prints one JSON line: how many
of the two runs' token sequences are identical, where the first difference
falls (tokens after the failure), and the fault-free run's acceptance.
"""
from __future__ import annotations

import argparse
import json
import statistics

from draft_service.drafters import ModelDrafter
from specdec.bench.tiny_pair import ensure_tiny_pair, tiny_prompts
from specdec.engine.config import EngineConfig
from specdec.engine.engine import ModelEngine
from specdec.errors import Unavailable
from tests.harness import running_system


class FailingDraft:
    """Patches ModelDrafter.propose: while `on`, each session's fail_at-th
    and later Propose calls fail."""

    def __init__(self, fail_at: int):
        self.fail_at, self.on, self.calls = fail_at, False, {}
        real = ModelDrafter.propose
        failing = self

        def propose(drafter, session_id, keep_length, append, k):
            failing.calls[session_id] = failing.calls.get(session_id, 0) + 1
            if failing.on and failing.calls[session_id] >= failing.fail_at:
                raise Unavailable("injected draft failure")
            return real(drafter, session_id, keep_length, append, k)

        ModelDrafter.propose = propose


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--fail-at", type=int, default=3, help="the draft's Propose call that fails first")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    draft_dir, target_dir = ensure_tiny_pair()
    engines = [ModelEngine.load(EngineConfig(model=str(d), dtype="float32", threads=1, max_context=1024,
                                             max_sessions=8)) for d in (target_dir, draft_dir)]
    failing = FailingDraft(args.fail_at)
    identical, first_diff, proposed, accepted, fallback = 0, [], 0, 0, 0
    with running_system(*engines, draft_retry_s=600.0) as s:
        for i, prompt in enumerate(tiny_prompts(args.requests, seed=7)):
            kwargs = {"max_tokens": args.tokens, "temperature": args.temperature, "top_p": args.top_p,
                      "seed": 1000 + i, "num_draft_tokens": args.num_draft_tokens}
            failing.on = False
            clean = s.client.complete(prompt, **kwargs)
            failing.on = True
            faulted = s.client.complete(prompt, **kwargs)
            proposed += clean.stats.proposed_tokens
            accepted += clean.stats.accepted_tokens
            fallback += faulted.stats.fallback_rounds > 0
            diff = next((j for j, (a, b) in enumerate(zip(clean.token_ids, faulted.token_ids)) if a != b), None)
            if diff is None and len(clean.token_ids) == len(faulted.token_ids):
                identical += 1
            else:
                first_diff.append(diff if diff is not None else min(len(clean.token_ids), len(faulted.token_ids)))
    print(json.dumps({
        "requests": args.requests, "tokens": args.tokens, "fail_at_propose": args.fail_at,
        "temperature": args.temperature, "top_p": args.top_p, "num_draft_tokens": args.num_draft_tokens,
        "faulted_runs_with_fallback_rounds": fallback,
        "identical": identical,
        "first_difference_median": statistics.median(first_diff) if first_diff else None,
        "clean_acceptance": round(accepted / proposed, 3) if proposed else None}))


if __name__ == "__main__":
    main()
