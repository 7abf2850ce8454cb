"""The orchestrator end to end: exactness (greedy identity, sampled
distribution), batching, seeding, fallback, cancellation and bad requests.
All three services run in-process on 127.0.0.1:0 with tiny models."""
from __future__ import annotations

import concurrent.futures
import copy
import time

import grpc
import pytest
import torch
from scipy.stats import chisquare

from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.client import Client, build_request
from specdec.sampling.params import SamplingParams
from specdec.sampling.transform import logits_to_probs
from specdec.v1 import orchestrator_pb2 as pb
from tests.conftest import tiny_engine, tiny_model
from tests.harness import (BackgroundLoop, complete_seeds, running_draft, running_system, running_target,
                           start_orchestrator_on_replicas, target_replicas_behind_one_name)

GREEDY_PROMPTS = [[3 + (7 * i + j * j) % 120 for j in range(2 + i % 9)] for i in range(24)]


def perturbed(model, scale: float, seed: int):
    """A draft that mostly agrees with the target: its weights plus noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return draft


def greedy_reference(model, prompt, n):
    """Target-only greedy decoding, recomputing the whole sequence each step."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def same_as_reference(tokens: list[int], ref: list[int]) -> bool:
    """`tokens` are the greedy reference: all of it, or cut where the
    reference emits the eos (not merely a prefix: output cut short must fail)."""
    return tokens == ref[:len(tokens)] and (len(tokens) == len(ref) or ref[len(tokens)] == EOS)


@pytest.fixture(scope="module")
def greedy_system():
    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.15, seed=1)
    with running_system(tiny_engine(model=target), tiny_engine(model=draft)) as system:
        system.target_model = target
        yield system


def test_greedy_output_is_identical_to_target_only_under_concurrency(greedy_system):
    s = greedy_system
    n = 24
    refs = [greedy_reference(s.target_model, p, n) for p in GREEDY_PROMPTS]
    batches_before = s.orchestrator.backends.targets.any().batcher.batches_sent

    def run(i):
        kwargs = dict(max_tokens=n, temperature=0, num_draft_tokens=1 + i % 8)
        if i % 6 == 5:
            kwargs["policy"] = "adaptive"
        return s.client.__class__(f"127.0.0.1:{s.orchestrator.port}").complete(GREEDY_PROMPTS[i], **kwargs)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(len(GREEDY_PROMPTS))))
    for i, (result, ref) in enumerate(zip(results, refs)):
        assert result.token_ids == ref[: len(result.token_ids)], f"prompt {i}"
        if result.stats.finish_reason == pb.FINISH_REASON_LENGTH:
            assert len(result.token_ids) == n
    rounds = sum(r.stats.rounds for r in results)
    assert sum(r.stats.accepted_tokens for r in results) > 0, "the draft should agree sometimes"
    assert sum(r.stats.accepted_tokens for r in results) < sum(r.stats.proposed_tokens for r in results)
    assert s.orchestrator.backends.targets.any().batcher.batches_sent - batches_before < rounds, "no verify was batched"


def test_greedy_without_speculation_equals_reference(greedy_system):
    s = greedy_system
    result = s.client.complete(GREEDY_PROMPTS[0], max_tokens=12, temperature=0, speculate=False)
    assert same_as_reference(list(result.token_ids), greedy_reference(s.target_model, GREEDY_PROMPTS[0], 12))
    assert result.stats.proposed_tokens == 0 and result.stats.policy == "none"


def test_final_statistics_are_consistent(greedy_system):
    result = greedy_system.client.complete(GREEDY_PROMPTS[3], max_tokens=20, temperature=0, num_draft_tokens=3)
    st = result.stats
    assert st.completion_tokens == len(result.token_ids) == 20
    assert st.prompt_tokens == len(GREEDY_PROMPTS[3])
    assert st.rounds == sum(st.k.histogram)
    assert st.proposed_tokens == sum(k * n for k, n in enumerate(st.k.histogram))
    assert st.accepted_tokens == sum(st.accepted_per_position)
    assert st.completion_tokens == st.accepted_tokens + st.rounds
    assert st.acceptance_rate == pytest.approx(st.accepted_tokens / st.proposed_tokens)
    assert st.time_to_first_token_s > 0 and st.tokens_per_second > 0 and st.wire_bytes > 0
    # The prefills come before the first token, and within the request.
    assert 0 < st.prefill_time_s < st.time_to_first_token_s <= st.duration_s
    assert st.k.max <= 3
    assert st.finish_reason == pb.FINISH_REASON_LENGTH
    assert st.rejected_rounds == rejected_rounds_of(st, 3)
    # Two opens, a Verify per round, a Propose per round that drafted, two closes.
    assert st.round_trips == 4 + st.rounds + (st.rounds - st.k.histogram[0])
    # This pair rarely agrees on 3 drafts in a row (that request had no full
    # round): a k = 1 request, whose drafts often are all accepted, checks
    # that full acceptances are not counted as rejections.
    one = greedy_system.client.complete(GREEDY_PROMPTS[5], max_tokens=20, temperature=0, num_draft_tokens=1).stats
    assert one.finish_reason == pb.FINISH_REASON_LENGTH and one.k.max == 1
    assert one.acceptance_histogram[1] > 0 and one.rejected_rounds > 0, "both kinds of round should occur"
    assert one.rejected_rounds == rejected_rounds_of(one, 1) == one.acceptance_histogram[0]


def rejected_rounds_of(st, k: int) -> int:
    """The speculative rounds (k > 0) of a fixed-k request that ended by
    length and accepted fewer than their k drafts, from its per-round k
    (k_per_round) and its acceptance histogram. A round drafts k unless capped
    to the tokens left less one (remaining - 1 < k); a capped round that
    accepted all its drafts emitted every token left, so it was the last.
    Hence the fully accepted rounds are those that accepted k, plus the last
    round when it was capped, and every other capped round was a rejection."""
    ks = list(st.k_per_round)
    assert len(ks) == st.rounds and [ks.count(j) for j in range(len(st.k.histogram))] == list(st.k.histogram)
    # (A capped round emits a token at least, so each cap is below the last.)
    assert all(ks[i] < ks[i - 1] for i in range(1, len(ks)) if ks[i] < k), ks
    speculative = sum(1 for j in ks if j > 0)
    assert sum(st.acceptance_histogram) == speculative
    assert sum(j * n for j, n in enumerate(st.acceptance_histogram)) == st.accepted_tokens
    full = (st.acceptance_histogram[k] if len(st.acceptance_histogram) > k else 0) + (0 < ks[-1] < k)
    return speculative - full


# ------------------------------------------------------------------ sampled

VOCAB = 8
EOS = 2
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repeats, so the n-gram drafter has matches
SAMPLES = 1200


def stats_model(seed: int, **kwargs):
    """A model of the statistical tests: one layer. Each of their samples is a
    whole request through the three services, and the forwards are most of
    a request's time there; the exactness they check does not depend on the
    model's depth (the engine's layers are checked against transformers in
    test_engine.py and test_fused_decoder.py)."""
    return tiny_model(seed=seed, layers=1, **kwargs)


def exact_two_token_distribution(model, params: SamplingParams) -> dict[tuple, float]:
    """P(completion) of a max_tokens=2 request: () if EOS comes first, (a,) if
    EOS follows a, else (a, b)."""
    with torch.inference_mode():
        p1 = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1:], params)[0]
        dist: dict[tuple, float] = {(): float(p1[EOS])}
        for a in range(VOCAB):
            if a == EOS or p1[a] == 0:
                continue
            p2 = logits_to_probs(model(torch.tensor([PROMPT + [a]])).logits[0, -1:], params)[0]
            dist[(a,)] = float(p1[a] * p2[EOS])
            for b in range(VOCAB):
                if b != EOS and p2[b] > 0:
                    dist[(a, b)] = float(p1[a] * p2[b])
    return dist


def assert_matches(counts: dict[tuple, int], exact: dict[tuple, float], n: int) -> None:
    assert set(counts) <= set(exact), f"impossible outcomes: {set(counts) - set(exact)}"
    # Merge outcomes with small expectations so chi-square is valid.
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for outcome, prob in sorted(exact.items(), key=lambda kv: -kv[1]):
        if prob * n >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(prob * n)
        else:
            rest_o += counts.get(outcome, 0)
            rest_e += prob * n
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    if len(expected) < 2:  # a deterministic outcome: nothing to test statistically
        assert observed[0] == n
        return
    scale = sum(observed) / sum(expected)
    result = chisquare(observed, [e * scale for e in expected])
    assert result.pvalue > 1e-3, f"chi-square p={result.pvalue:.2e}; observed {observed} expected {expected}"


def first_token_counts(counts: dict[tuple, int]) -> dict[tuple, int]:
    first: dict[tuple, int] = {}
    for outcome, c in counts.items():
        key = outcome[:1] if outcome else ()
        first[key] = first.get(key, 0) + c
    return first


def first_token_exact(exact: dict[tuple, float]) -> dict[tuple, float]:
    first: dict[tuple, float] = {}
    for outcome, p in exact.items():
        key = outcome[:1] if outcome else ()
        first[key] = first.get(key, 0.0) + p
    return first


SAMPLED_CASES = {
    # name: (draft kind, temperature, top_k, top_p)
    "t1-poor-draft": ("poor", 1.0, 0, 1.0),
    "t07-topk-poor-draft": ("poor", 0.7, 4, 1.0),
    "topp-poor-draft": ("poor", 1.0, 0, 0.8),
    "t1-perfect-draft": ("perfect", 1.0, 0, 1.0),
    "t07-ngram": ("ngram", 0.7, 0, 1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_sampled_output_is_distributed_as_the_target(case):
    kind, temperature, top_k, top_p = SAMPLED_CASES[case]
    target = stats_model(0, vocab_size=VOCAB, init_range=0.2)
    draft = {"poor": stats_model(7, vocab_size=VOCAB, init_range=0.2), "perfect": target}.get(kind)
    exact = exact_two_token_distribution(target, SamplingParams(temperature, top_k, top_p))
    counts: dict[tuple, int] = {}
    proposed = accepted = 0
    with running_system(tiny_engine(model=target), tiny_engine(model=draft) if draft is not None else None,
                        ngram=kind == "ngram") as s:
        results = complete_seeds(s, PROMPT, range(SAMPLES), max_tokens=2, temperature=temperature, top_k=top_k,
                                 top_p=top_p, num_draft_tokens=1)
    for r in results:
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
        proposed += r.stats.proposed_tokens
        accepted += r.stats.accepted_tokens
    assert proposed > 0
    if kind == "perfect":
        assert accepted == proposed, "a draft with the target's weights is always accepted"
    else:
        assert accepted < proposed
    assert_matches(first_token_counts(counts), first_token_exact(exact), SAMPLES)
    assert_matches(counts, exact, SAMPLES)


# ---------------------------------------------------------- reproducibility

@pytest.mark.parametrize("stop", [0.0, 0.3], ids=["every-draft", "early-stop"])
def test_seeded_request_reproduces_alone_and_under_concurrency(stop):
    # With an early stop each round's length depends on the draft's own
    # (seeded) samples only, so a seeded request still reproduces.
    target = tiny_model(seed=0, init_range=0.3)
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.2, 3)),
                        draft_min_confidence=stop) as s:
        kwargs = dict(max_tokens=20, temperature=0.8, top_p=0.95, seed=1234, num_draft_tokens=3)
        alone = s.client.complete(GREEDY_PROMPTS[1], **kwargs).token_ids
        assert s.client.complete(GREEDY_PROMPTS[1], **kwargs).token_ids == alone

        def run(i):
            client = s.client.__class__(f"127.0.0.1:{s.orchestrator.port}")
            if i == 0:
                return client.complete(GREEDY_PROMPTS[1], **kwargs).token_ids
            return client.complete(GREEDY_PROMPTS[i], max_tokens=10 + i, temperature=1.0, seed=i,
                                   num_draft_tokens=1 + i % 5).token_ids

        for _ in range(2):
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                results = list(pool.map(run, range(6)))
            assert results[0] == alone
        other = s.client.complete(GREEDY_PROMPTS[1], **{**kwargs, "seed": 99}).token_ids
        assert other != alone
        if stop:
            ks = s.client.complete(GREEDY_PROMPTS[1], **kwargs).stats.k_per_round
            assert any(0 < k < 3 for k in ks[:2]), "no round stopped early: the case tests nothing new"


# ------------------------------------------------------ degradation, cleanup

def test_draft_stopped_mid_stream_falls_back_exactly_and_recovers():
    target = tiny_model(seed=0, init_range=0.3)
    draft_engine = tiny_engine(model=perturbed(target, 0.15, 1))
    ref = greedy_reference(target, GREEDY_PROMPTS[2], 40)
    with running_system(tiny_engine(model=target), draft_engine, draft_retry_s=0.05) as s:
        tokens, stats = generate_stopping_the_draft(s, GREEDY_PROMPTS[2], 40)
        assert tokens == ref[: len(tokens)] and len(tokens) == 40
        assert stats.fallback_rounds > 0

        # The draft comes back on the same address: speculation resumes.
        port = s.draft.port
        with running_draft(draft_engine, server_cfg=_port(port)):
            deadline = time.monotonic() + 15  # within the channel's reconnect backoff
            while True:
                again = s.client.complete(GREEDY_PROMPTS[2], max_tokens=20, temperature=0, num_draft_tokens=2)
                assert again.token_ids == ref[:20]
                if again.stats.proposed_tokens > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert again.stats.proposed_tokens > 0, "speculation did not resume"


def read_stopping(stream, stop) -> tuple[list[int], object]:
    """Read a Generate stream, calling `stop()` after its second chunk:
    (the tokens, the final stats)."""
    tokens, stats = [], None
    for i, reply in enumerate(stream):
        if reply.HasField("stats"):
            stats = reply.stats
            break
        tokens.extend(reply.chunk.token_ids)
        if i == 1:
            stop()
    return tokens, stats


def generate_stopping_the_draft(s, prompt, n):
    """Greedy k=2 generation of n tokens; the draft service stops after the
    second chunk. Returns (tokens, final stats)."""
    stream = s.client.stub.Generate(build_request(prompt, max_tokens=n, temperature=0, num_draft_tokens=2),
                                    timeout=60)
    return read_stopping(stream, lambda: s.draft_loop.run(s.draft.stop(0)))


def assert_cancel_and_deadline_free_the_sessions(s, target_engine, draft_engine, chunks_first=1):
    """A cancelled stream and a request past its deadline leave no session open."""
    stream = s.client.stub.Generate(build_request(GREEDY_PROMPTS[4], max_tokens=500, temperature=0), timeout=60)
    for _ in range(chunks_first):
        next(iter(stream))
    stream.cancel()
    assert _wait_until(lambda: target_engine.num_sessions == 0 and draft_engine.num_sessions == 0)
    with pytest.raises(grpc.RpcError) as err:
        for _ in s.client.stub.Generate(build_request(GREEDY_PROMPTS[4], max_tokens=900, temperature=0),
                                        timeout=0.3):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_until(lambda: target_engine.num_sessions == 0 and draft_engine.num_sessions == 0)


def _port(port):
    from tests.harness import local_config

    cfg = local_config()
    cfg.port = port
    return cfg


def _wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def without_eos(model):
    """The model never ends a generation by itself."""
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    return model


def test_cancellation_and_deadlines_free_the_sessions_on_both_services():
    target_engine = tiny_engine(model=without_eos(tiny_model(seed=0)))
    draft_engine = tiny_engine(seed=1)
    with running_system(target_engine, draft_engine) as s:
        stream = s.client.stub.Generate(build_request(GREEDY_PROMPTS[4], max_tokens=500, temperature=0), timeout=60)
        next(iter(stream))
        assert target_engine.num_sessions == 1 and draft_engine.num_sessions == 1
        stream.cancel()
        assert _wait_until(lambda: target_engine.num_sessions == 0 and draft_engine.num_sessions == 0)
        assert_cancel_and_deadline_free_the_sessions(s, target_engine, draft_engine)


def test_target_failure_ends_the_request_with_unavailable_once_no_replica_comes_back():
    with running_system(tiny_engine(model=without_eos(tiny_model(seed=0))), tiny_engine(seed=1),
                        target_recovery_s=1.0, health_interval_s=0.1) as s:
        health = health_pb2_grpc.HealthStub(s.client.channel)
        stream = s.client.stub.Generate(build_request(GREEDY_PROMPTS[5], max_tokens=400, temperature=0), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            for i, _ in enumerate(stream):
                if i == 1:
                    s.target_loop.run(s.target.stop(0))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target" in err.value.details() and "re-open" in err.value.details()
        # No target replica is reachable: the orchestrator says so, to readiness
        # (its service's status); liveness ("") stays SERVING: the process is fine.
        ready = health_pb2.HealthCheckRequest(service="specdec.v1.OrchestratorService")
        assert _wait_until(lambda: health.Check(ready, timeout=5).status
                           == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def generate_restarting_the_target(s, target_model, prompt, n, engine_cfg=None, **kwargs):
    """Generate n tokens; after the second chunk the target service stops, and a
    new one (a fresh engine over the same model, `engine_cfg` its EngineConfig
    fields) starts on the same port. Returns (tokens, final stats)."""
    port = s.target.port
    stream = s.client.stub.Generate(build_request(prompt, max_tokens=n, **kwargs), timeout=60)
    tokens, stats, restarted = [], None, None
    try:
        for i, reply in enumerate(stream):
            if reply.HasField("stats"):
                stats = reply.stats
                break
            tokens.extend(reply.chunk.token_ids)
            if i == 1:
                s.target_loop.run(s.target.stop(0))
                restarted = running_target(tiny_engine(model=target_model, **(engine_cfg or {})),
                                           server_cfg=_port(port))
                restarted.__enter__()
    finally:
        if restarted is not None:
            restarted.__exit__(None, None, None)
    return tokens, stats


def test_target_restarted_mid_request_is_recovered_with_identical_output():
    target = without_eos(tiny_model(seed=0, init_range=0.3))
    ref = greedy_reference(target, GREEDY_PROMPTS[2], 40)
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.15, 1))) as s:
        tokens, stats = generate_restarting_the_target(s, target, GREEDY_PROMPTS[2], 40, temperature=0,
                                                       num_draft_tokens=2)
    assert tokens == ref and stats.target_recoveries >= 1


def test_a_request_that_fills_the_context_is_recovered_after_a_target_restart():
    """prompt + max_tokens = max_context: the re-open carries the tokens
    emitted so far and asks only for those still to come (asking for the
    whole max_tokens again, it was refused, and the request failed once the
    recovery window ended)."""
    target = without_eos(tiny_model(seed=0, init_range=0.3))
    prompt = GREEDY_PROMPTS[8]
    n = 64 - len(prompt)
    ref = greedy_reference(target, prompt, n)
    with running_system(tiny_engine(model=target, max_context=64),
                        tiny_engine(model=perturbed(target, 0.15, 1), max_context=64), target_recovery_s=5.0) as s:
        tokens, stats = generate_restarting_the_target(s, target, prompt, n, engine_cfg={"max_context": 64},
                                                       temperature=0, num_draft_tokens=2)
    assert tokens == ref and stats.target_recoveries >= 1


def test_seeded_sampled_request_keeps_its_tokens_through_a_target_restart():
    target = without_eos(tiny_model(seed=0, init_range=0.3))
    kwargs = dict(temperature=0.8, top_p=0.95, seed=4321, num_draft_tokens=3)
    with running_system(tiny_engine(model=target), tiny_engine(model=perturbed(target, 0.2, 3))) as s:
        alone = s.client.complete(GREEDY_PROMPTS[1], max_tokens=30, **kwargs).token_ids
        tokens, stats = generate_restarting_the_target(s, target, GREEDY_PROMPTS[1], 30, **kwargs)
    assert tokens == alone and stats.target_recoveries >= 1


def test_a_failed_target_replica_is_replaced_by_a_live_one(monkeypatch):
    # Two replicas behind one name (as in test_replicas.py); the request's
    # replica stops mid-stream and the session moves to the other.
    target = without_eos(tiny_model(seed=0, init_range=0.3))
    ref = greedy_reference(target, GREEDY_PROMPTS[3], 30)
    engine_a, engine_b = tiny_engine(model=target), tiny_engine(model=copy.deepcopy(target))  # each fuses its own
    with target_replicas_behind_one_name(monkeypatch, engine_a, engine_b) as (port, (svc_a, loop_a), (svc_b, loop_b)):
        loop = BackgroundLoop()
        try:
            orch = start_orchestrator_on_replicas(loop, port)
            try:
                def stop_the_requests_replica():
                    service, its_loop = (svc_a, loop_a) if engine_a.num_sessions else (svc_b, loop_b)
                    its_loop.run(service.stop(0))

                with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                    stream = client.stub.Generate(build_request(GREEDY_PROMPTS[3], max_tokens=30, temperature=0),
                                                  timeout=60)
                    tokens, stats = read_stopping(stream, stop_the_requests_replica)
                assert tokens == ref and stats.target_recoveries == 1
            finally:
                loop.run(orch.stop(0))
        finally:
            loop.close()


def test_requests_in_flight_are_exported_as_a_gauge():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from specdec.telemetry import Telemetry

    reader = InMemoryMetricReader()
    telemetry = Telemetry("specdec-orchestrator", meter_provider=MeterProvider(metric_readers=[reader]))
    with running_system(tiny_engine(model=without_eos(tiny_model(seed=0))), None,
                        telemetry={"orchestrator": telemetry}) as s:
        stream = s.client.stub.Generate(build_request(GREEDY_PROMPTS[4], max_tokens=300, temperature=0), timeout=60)
        next(iter(stream))
        assert _gauge(reader, "specdec_requests_in_flight") == 1
        stream.cancel()
        assert _wait_until(lambda: _gauge(reader, "specdec_requests_in_flight") == 0)


def _gauge(reader, name):
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    return sum(p.value for p in metric.data.data_points)
    return None


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "no input"),
    (dict(prompt="hello"), "no tokenizer"),
    (dict(prompt=[3, 999]), "outside the vocabulary"),
    (dict(prompt=[3], max_tokens=100000), "max_tokens"),
    (dict(prompt=[3], max_tokens=1024), "context"),
    (dict(prompt=[3], temperature=-1.0), "temperature"),
    (dict(prompt=[3], temperature=float("nan")), "temperature"),
    (dict(prompt=[3], top_p=1.5), "top_p"),
    (dict(prompt=[3], top_k=-2), "top_k"),
    (dict(prompt=[3], policy="psychic"), "unknown policy"),
    (dict(prompt=[3], num_draft_tokens=99), "num_draft_tokens must be in [1, 8], got 99"),
    (dict(prompt=[3], stop=[""]), "stop"),
    (dict(prompt=[3], stop=["\n"]), "no tokenizer"),
    (dict(prompt=[3], request_id="x" * 257), "request_id is limited to 256 characters"),
])
def test_bad_requests_get_invalid_argument(greedy_system, kwargs, message):
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as err:
        list(greedy_system.client.generate(prompt, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_the_orchestrator_refuses_a_default_policy_beyond_the_limit_in_force():
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import check_defaults
    from specdec.errors import FailedPrecondition

    check_defaults(OrchestratorConfig(), 8)
    check_defaults(OrchestratorConfig(num_draft_tokens=2), 2)
    with pytest.raises(FailedPrecondition, match=r"max_draft_tokens = 2 .*num_draft_tokens must be in \[1, 2\], got 4"):
        check_defaults(OrchestratorConfig(num_draft_tokens=4), 2)  # a service advertising a smaller limit
