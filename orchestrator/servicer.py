"""OrchestratorService.Generate: parse the request, run the speculative loop,
stream text as soon as tokens are accepted, end with the request's statistics."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from orchestrator.config import OrchestratorConfig
from orchestrator.detokenizer import IncrementalDetokenizer
from orchestrator.gamma_policy import make_policy
from orchestrator.prompt import max_token_chars, prompt_tokens
from orchestrator.recovery import RecoverySettings, TargetLease
from orchestrator.replicas import ReplicaPool
from orchestrator.reply_relay import written_behind
from orchestrator.request_stats import RequestSpec
from orchestrator.speculation import LoopSettings, SpeculativeRequest
from orchestrator.stop import StopMatcher, validate_stops
from specdec.errors import InvalidArgument, Unavailable
from specdec.rpc import grpc_errors
from specdec.sampling.params import SamplingParams
from specdec.sampling.rng import random_seed
from specdec.telemetry import (A_ACCEPTANCE_RATE, A_ACCEPTED_TOKENS, A_DRAFT_MODEL, A_FALLBACK_ROUNDS, A_POLICY,
                               A_PROPOSED, A_REQUEST_ID, A_ROUNDS, A_SEED, A_TTFT, GEN_AI_FINISH_REASONS,
                               GEN_AI_INPUT_TOKENS, GEN_AI_MAX_TOKENS, GEN_AI_OPERATION, GEN_AI_OUTPUT_TOKENS,
                               GEN_AI_REQUEST_MODEL, GEN_AI_RESPONSE_MODEL, GEN_AI_TEMPERATURE, GEN_AI_TOP_K,
                               GEN_AI_TOP_P, NOOP, SPAN_GENERATE, Telemetry)
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger(__name__)

_FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP, "eos": pb.FINISH_REASON_EOS}


@dataclass
class Backends:
    targets: ReplicaPool  # replicas carry a TargetClient and its VerifyBatcher
    drafts: ReplicaPool | None  # replicas carry a DraftClient
    tokenizer: object | None
    settings: LoopSettings
    eos_ids: frozenset[int]
    vocab_size: int
    recovery: RecoverySettings = RecoverySettings()

    def on_gpus(self) -> bool:
        """Whether every service replica connected so far said its models run
        on a GPU (ModelInfo.device; an n-gram drafter has none and does not
        count), as the busy-poll default asks of them."""
        pools = [self.targets] + ([self.drafts] if self.drafts is not None else [])
        infos = [replica.client.info for pool in pools for replica in pool.replicas.values()]
        if None in infos:  # a replica not yet described
            return False
        # An n-gram drafter runs no model: its few lookups leave the CPUs to spare.
        with_models = [info for info in infos if info.backend != "ngram"]
        return bool(with_models) and all(info.device.startswith("cuda") for info in with_models)


# A request's id (gRPC request_id, HTTP X-Request-Id) is the client's to
# choose and is recorded on its trace: one of megabytes went into every
# exporter and the trace file.
MAX_REQUEST_ID_CHARS = 256


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, cfg: OrchestratorConfig, backends: Backends, telemetry: Telemetry = NOOP):
        self.cfg = cfg
        self.b = backends
        self.telemetry = telemetry
        self.in_flight = 0  # Generate calls running now (the specdec_requests_in_flight gauge)
        # What bounds a text's tokens before it is tokenized (orchestrator/prompt.py).
        self._longest_token = max_token_chars(backends.tokenizer) if backends.tokenizer is not None else 0
        telemetry.metrics.observe_requests_in_flight(lambda: self.in_flight)

    @grpc_errors.stream
    async def Generate(self, request, context):
        # The root of the request's trace (or a child of the client's span,
        # when the call carries one). The loop runs ahead of the stream's
        # writes (orchestrator/reply_relay.py): a round does not wait for the
        # last round's chunk to be written.
        # The span is current only in the task that runs the request
        # (`written_behind`'s), never across this generator's yields.
        with self.telemetry.owned_server_span(SPAN_GENERATE, context.invocation_metadata()) as owned:
            async for reply in written_behind(self.generate(request, owned.span, context.time_remaining()),
                                              owned.context):
                yield reply

    async def generate(self, request: pb.GenerateRequest, span, time_remaining: float | None):
        """The request path every front door shares (gRPC Generate, the
        OpenAI-compatible HTTP API): validate, run the loop, stream chunks,
        end with the statistics. Raises the core's errors (`specdec.errors`);
        `span` is the request's `generate` span, `time_remaining` its deadline
        in seconds (None: none). Counted in the requests-in-flight gauge."""
        self.in_flight += 1
        try:
            async for reply in self._generate(request, span, time_remaining):
                yield reply
        finally:
            self.in_flight -= 1

    def _draft_replica(self):
        """The request's draft replica, or None (target-only rounds, as while
        a draft is down) when every draft replica is refused (`ReplicaPool.recheck`)."""
        try:
            return self.b.drafts.acquire()
        except Unavailable as exc:
            log.warning("decoding with the target alone: %s", exc)
            return None

    async def _generate(self, request: pb.GenerateRequest, span, time_remaining: float | None):
        start = time.perf_counter()
        prompt = await prompt_tokens(request, self.b.tokenizer, self.b.vocab_size, self.b.settings.max_context,
                                     self._longest_token)
        spec, policy, stops = self._parse(request, prompt, time_remaining)
        target = TargetLease(self.b.targets, self.b.recovery)
        draft = self._draft_replica() if spec.speculate else None
        loop = SpeculativeRequest(spec, policy, target.client, target.batcher,
                                  draft.client if draft else None, self.b.settings, self.telemetry, lease=target)
        if draft is not None:
            loop.sessions.pin_draft(self.b.drafts, draft)  # a failed draft call marks it down
        if span.is_recording():
            span.set_attributes(_request_attributes(request, loop, policy))
        detok = IncrementalDetokenizer(self.b.tokenizer, prompt) if self.b.tokenizer else None
        stop = StopMatcher(stops)
        first_token_s = None
        try:
            async for tokens in loop.run():
                if first_token_s is None:
                    first_token_s = time.perf_counter() - start
                text, stopped, kept = _feed(detok, stop, tokens, bool(stops))
                if kept < len(tokens):  # a stop completed mid-round: the tokens after it are not the output
                    loop.stats.cut_last_round(len(tokens) - kept)
                    tokens = tokens[:kept]
                yield pb.GenerateResponse(chunk=pb.TextChunk(text=text, token_ids=tokens))
                if stopped:
                    loop.finish_reason = "stop"
                    break
            else:
                tail = ""
                if detok is not None:
                    tail, _ = stop.feed(detok.flush())
                    tail += stop.flush()
                    if stop.stopped:
                        loop.finish_reason = "stop"
                if tail:
                    yield pb.GenerateResponse(chunk=pb.TextChunk(text=tail))
        finally:
            loop.close()
            await target.release()
            await loop.sessions.release_draft()  # the replica it is on by now (a failed draft's request moves)
        stats = self._stats(loop, policy, start, first_token_s)
        self.telemetry.metrics.record_request(stats.duration_s, first_token_s, stats.completion_tokens,
                                              loop.finish_reason)
        if span.is_recording():
            span.set_attributes(_result_attributes(stats, loop.finish_reason))
        yield pb.GenerateResponse(stats=stats)

    # --------------------------------------------------------------- parsing

    def _parse(self, request, prompt: list[int], time_remaining: float | None):
        cfg = self.cfg
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # it is recorded on the request's span
            raise InvalidArgument(f"request_id is limited to {MAX_REQUEST_ID_CHARS} characters, "
                                  f"got {len(request.request_id)}")
        max_tokens = request.max_tokens or cfg.default_max_tokens
        if not 1 <= max_tokens <= cfg.max_tokens_limit:
            raise InvalidArgument(f"max_tokens must be in [1, {cfg.max_tokens_limit}], got {request.max_tokens}")
        if len(prompt) + max_tokens > self.b.settings.max_context:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                f"limit of {self.b.settings.max_context} tokens"
            )
        temperature = request.temperature if request.HasField("temperature") else 1.0
        top_p = request.top_p if request.HasField("top_p") else 1.0
        try:
            params = SamplingParams(temperature=temperature, top_k=request.top_k, top_p=top_p).validate()
            stops = validate_stops(list(request.stop))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if stops and self.b.tokenizer is None:
            raise InvalidArgument("stop strings need text, and this server has no tokenizer: "
                                  "start the orchestrator with --tokenizer, or leave stop empty")
        opts = request.speculation
        limit = self.b.settings.max_draft_tokens  # the orchestrator's and both services' smallest
        min_confidence = (opts.draft_min_confidence if opts.HasField("draft_min_confidence")
                          else cfg.draft_min_confidence)
        try:
            policy = make_policy(opts.policy or cfg.policy, opts.num_draft_tokens or cfg.num_draft_tokens,
                                 opts.min_draft_tokens or cfg.min_draft_tokens, opts.max_draft_tokens or limit, limit,
                                 min_confidence)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        spec = RequestSpec(
            prompt=prompt, max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
            top_p=params.top_p, seed=request.seed if request.HasField("seed") else random_seed(),
            eos_ids=self.b.eos_ids, speculate=not opts.disable and self.b.drafts is not None,
            request_id=request.request_id,
            pipeline=opts.pipeline if opts.HasField("pipeline") else cfg.pipeline,
            deadline=None if time_remaining is None else time.monotonic() + time_remaining,
        )
        return spec, policy, stops

    # ------------------------------------------------------------ statistics

    def _stats(self, loop: SpeculativeRequest, policy, start: float, first_token_s: float | None) -> pb.GenerateResponse:
        s = loop.stats
        duration = time.perf_counter() - start
        ks = [k for k, n in enumerate(s.k_histogram) for _ in range(n)]
        # One bin per number of drafts a round could accept: 0..k.max.
        acceptance = s.acceptance_histogram + [0] * (len(s.k_histogram) - len(s.acceptance_histogram))
        return pb.GenerateStats(
            prompt_tokens=len(loop.spec.prompt),
            completion_tokens=s.completion_tokens,
            rounds=s.rounds,
            proposed_tokens=s.proposed,
            accepted_tokens=s.accepted,
            acceptance_rate=s.accepted / s.proposed if s.proposed else 0.0,
            mean_tokens_per_round=s.completion_tokens / s.rounds if s.rounds else 0.0,
            k=pb.KSummary(min=min(ks, default=0), max=max(ks, default=0),
                          mean=sum(ks) / len(ks) if ks else 0.0, histogram=s.k_histogram),
            time_to_first_token_s=first_token_s or 0.0,
            tokens_per_second=s.completion_tokens / duration if duration > 0 else 0.0,
            duration_s=duration,
            finish_reason=_FINISH[loop.finish_reason],
            seed=loop.spec.seed,
            accepted_per_position=s.accepted_per_position,
            fallback_rounds=s.fallback_rounds,
            plain_rounds=s.plain_rounds,
            draft_time_s=s.draft_time_s,
            draft_compute_time_s=s.draft_compute_s,
            round_trips=s.round_trips,
            pipelined_rounds=s.pipelined_rounds,
            rejected_rounds=s.rejected_rounds,
            target_recoveries=s.target_recoveries,
            acceptance_histogram=acceptance,
            k_per_round=s.k_per_round,
            prefill_time_s=s.prefill_time_s,
            verify_time_s=s.verify_time_s,
            target_compute_time_s=s.target_compute_s,
            wire_bytes=s.wire_bytes,
            draft_model=loop.draft.info.model_name if loop.draft is not None and loop.draft.info else "",
            target_model=loop.target.info.model_name if loop.target.info else "",
            policy=policy.name if loop.spec.speculate else "none",
        )


def _feed(detok, stop: StopMatcher, tokens: list[int], has_stops: bool) -> tuple[str, bool, int]:
    """A round's tokens through the detokenizer and the stop strings: (the
    text to send, whether a stop matched, how many of the tokens are output).
    With stop strings they go one at a time, so that a stop completed by a
    round's second token ends the output there: the tokens after it were
    reported (token_ids, completion_tokens, usage) though their text was not.
    The text is the same either way (the detokenizer's and the matcher's
    output do not depend on how the tokens are grouped); one at a time costs
    about 1 µs a token more, so only requests with stop strings pay it."""
    if detok is None:
        return "", False, len(tokens)
    if not has_stops or len(tokens) == 1:
        text, stopped = stop.feed(detok.add(tokens))
        return text, stopped, len(tokens)
    pieces = []
    for kept, token in enumerate(tokens, 1):
        piece, stopped = stop.feed(detok.add([token]))
        pieces.append(piece)
        if stopped:
            return "".join(pieces), True, kept
    return "".join(pieces), False, len(tokens)


def _request_attributes(request, loop: SpeculativeRequest, policy) -> dict:
    spec = loop.spec
    target_model = loop.target.info.model_name if loop.target.info else ""
    attrs = {
        GEN_AI_OPERATION: "chat" if request.WhichOneof("input") == "messages" else "text_completion",
        GEN_AI_REQUEST_MODEL: target_model,
        GEN_AI_MAX_TOKENS: spec.max_tokens,
        GEN_AI_TEMPERATURE: spec.temperature,
        GEN_AI_TOP_P: spec.top_p,
        GEN_AI_TOP_K: spec.top_k,
        GEN_AI_INPUT_TOKENS: len(spec.prompt),
        A_SEED: spec.seed,
        A_POLICY: policy.name if spec.speculate else "none",
    }
    if loop.draft is not None and loop.draft.info is not None:
        attrs[A_DRAFT_MODEL] = loop.draft.info.model_name
    if spec.request_id:
        attrs[A_REQUEST_ID] = spec.request_id
    return attrs


def _result_attributes(stats: pb.GenerateStats, finish_reason: str) -> dict:
    return {
        GEN_AI_RESPONSE_MODEL: stats.target_model,
        GEN_AI_OUTPUT_TOKENS: stats.completion_tokens,
        GEN_AI_FINISH_REASONS: (finish_reason,),
        A_ROUNDS: stats.rounds,
        A_PROPOSED: stats.proposed_tokens,
        A_ACCEPTED_TOKENS: stats.accepted_tokens,
        A_ACCEPTANCE_RATE: stats.acceptance_rate,
        A_FALLBACK_ROUNDS: stats.fallback_rounds,
        A_TTFT: stats.time_to_first_token_s,
    }
