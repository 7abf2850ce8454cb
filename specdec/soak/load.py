"""N concurrent streams of mixed Generate requests against an orchestrator.

Each stream sends one request after another until the run's end, then lets
its last one finish (the drain). A request's shape is drawn from a
`StreamMix` by a generator seeded with (run seed, stream), so a run is
reproducible: greedy or sampled-and-seeded, short or long, and a fraction of
them cancelled by the client after a few tokens or sent with a deadline
short enough to expire. Those two are the *planned* failures (CANCELLED,
DEADLINE_EXCEEDED); any other status is an unplanned error.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from orchestrator.client import build_request
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

OK = "OK"
# An OK stream that ended before max_tokens without a reason (eos, stop) to.
INCOMPLETE = "INCOMPLETE"


@dataclass(frozen=True)
class RequestPlan:
    stream: int
    index: int  # the request's number within its stream
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float  # 0: greedy
    seed: int | None  # sampled requests are seeded
    cancel_after: int | None  # the client cancels once it has this many tokens
    deadline_s: float | None  # a short deadline; None: the mix's request_timeout_s

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def request(self, top_p: float) -> pb.GenerateRequest:
        return build_request(list(self.prompt), max_tokens=self.max_tokens, temperature=self.temperature,
                             top_p=None if self.greedy else top_p, seed=self.seed)


@dataclass(frozen=True)
class StreamMix:
    """How requests are drawn. Fractions are of all requests."""

    vocab: tuple[int, int] = (3, 512)  # prompt token ids are drawn from [low, high)
    prompt_tokens: tuple[int, int] = (8, 48)
    sampled_fraction: float = 0.5  # temperature > 0 and a seed; the rest greedy
    temperature: float = 0.8
    top_p: float = 0.95
    long_fraction: float = 0.3
    short_tokens: tuple[int, int] = (8, 32)
    long_tokens: tuple[int, int] = (96, 192)
    cancel_fraction: float = 0.1
    cancel_after_tokens: tuple[int, int] = (1, 4)
    deadline_fraction: float = 0.1
    deadline_s: tuple[float, float] = (0.05, 0.4)
    request_timeout_s: float = 120.0  # the deadline of every other request

    def plan(self, rng: random.Random, stream: int, index: int) -> RequestPlan:
        prompt = tuple(rng.randrange(*self.vocab) for _ in range(rng.randint(*self.prompt_tokens)))
        sampled = rng.random() < self.sampled_fraction
        lengths = self.long_tokens if rng.random() < self.long_fraction else self.short_tokens
        action = rng.random()
        cancel = rng.randint(*self.cancel_after_tokens) if action < self.cancel_fraction else None
        deadline = (rng.uniform(*self.deadline_s)
                    if self.cancel_fraction <= action < self.cancel_fraction + self.deadline_fraction else None)
        return RequestPlan(stream=stream, index=index, prompt=prompt, max_tokens=rng.randint(*lengths),
                           temperature=self.temperature if sampled else 0.0,
                           seed=rng.randrange(1, 2 ** 31) if sampled else None,
                           cancel_after=cancel, deadline_s=deadline)


@dataclass
class Outcome:
    plan: RequestPlan
    status: str  # OK, INCOMPLETE or a gRPC status name
    started_s: float  # since the run's start
    seconds: float
    first_token_s: float | None
    tokens: list[int] = field(default_factory=list)
    detail: str = ""
    target_recoveries: int = 0
    fallback_rounds: int = 0

    @property
    def planned(self) -> bool:
        """OK, or the failure the plan asked for."""
        return (self.status == OK
                or (self.status == "CANCELLED" and self.plan.cancel_after is not None)
                or (self.status == "DEADLINE_EXCEEDED" and self.plan.deadline_s is not None))


async def one_request(stub, plan: RequestPlan, mix: StreamMix, t0: float) -> Outcome:
    start = time.monotonic()
    out = Outcome(plan, OK, start - t0, 0.0, None)
    call = stub.Generate(plan.request(mix.top_p), timeout=plan.deadline_s or mix.request_timeout_s)
    stats = None
    try:
        async for reply in call:
            if reply.HasField("stats"):
                stats = reply.stats
                continue
            if out.first_token_s is None:
                out.first_token_s = time.monotonic() - start
            out.tokens.extend(reply.chunk.token_ids)
            # (tokens, not chunks: a chunk carries every round that gathered while the last was written)
            if plan.cancel_after is not None and len(out.tokens) >= plan.cancel_after:
                call.cancel()
                out.status = "CANCELLED"
                break
    except grpc.aio.AioRpcError as exc:
        out.status, out.detail = exc.code().name, exc.details() or ""
    out.seconds = time.monotonic() - start
    if out.status == OK:
        if stats is None:
            out.status, out.detail = INCOMPLETE, "the stream ended without its statistics"
        else:
            out.target_recoveries, out.fallback_rounds = stats.target_recoveries, stats.fallback_rounds
            if stats.finish_reason == pb.FINISH_REASON_LENGTH and len(out.tokens) != plan.max_tokens:
                out.status, out.detail = INCOMPLETE, f"{len(out.tokens)} of {plan.max_tokens} tokens"
    return out


async def drive(address: str, mix: StreamMix, streams: int, duration_s: float, seed: int,
                t0: float | None = None) -> list[Outcome]:
    """Run `streams` streams for `duration_s` seconds, then drain: every
    stream's last request ends (by its own deadline at the latest)."""
    t0 = time.monotonic() if t0 is None else t0
    stop_at = time.monotonic() + duration_s
    outcomes: list[Outcome] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def stream(i: int) -> None:
            rng = random.Random(f"soak/{seed}/{i}")
            index = 0
            while time.monotonic() < stop_at:
                outcomes.append(await one_request(stub, mix.plan(rng, i, index), mix, t0))
                index += 1

        await asyncio.gather(*(stream(i) for i in range(streams)))
    return outcomes


async def target_only(address: str, plans: list[RequestPlan], timeout_s: float = 120.0,
                      concurrency: int = 4) -> list[list[int]]:
    """The tokens of each plan decoded by the target alone (speculation off),
    whole: the greedy reference of a fault run."""
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def one(plan: RequestPlan) -> list[int]:
            request = build_request(list(plan.prompt), max_tokens=plan.max_tokens, temperature=0, speculate=False)
            tokens: list[int] = []
            async with gate:
                async for reply in stub.Generate(request, timeout=timeout_s):
                    if not reply.HasField("stats"):
                        tokens.extend(reply.chunk.token_ids)
            return tokens

        return list(await asyncio.gather(*(one(p) for p in plans)))
