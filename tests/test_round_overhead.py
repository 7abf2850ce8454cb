"""What the loop tells its policy a round cost, end to end through
`SpeculativeRequest.run()` against fake services: a session opened between
two rounds (here the draft's re-open after a failure, a whole prefill) is
not a round's overhead (learned as overhead, it sent the goodput policy's k
to its maximum for several rounds)."""
from __future__ import annotations

import asyncio

import grpc

from orchestrator.batcher import VerifyReply
from orchestrator.downstream import CallCost
from orchestrator.request_stats import RequestSpec
from orchestrator.speculation import LoopSettings, SpeculativeRequest
from specdec.v1 import draft_pb2, target_pb2

PREFILL_S = 0.4  # the draft's re-open


class Gate:
    def speculate(self, active):
        return True

    def plain_now(self, active):
        return False

    def record(self, *args):
        pass


class FakeTarget:
    """Target client and batcher in one: greedy, every draft accepted."""

    name = "target"
    info = None
    active = 1
    gate = Gate()

    async def open(self, request, timeout):
        return "t", CallCost(0.0, 1)

    async def close(self, session_id, timeout):
        pass

    async def verify(self, item, timeout):
        await asyncio.sleep(0.002)
        ids = list(item.draft_token_ids) + [7]
        return VerifyReply(target_pb2.VerifyResult(argmax_token_ids=ids), 1, 0.001, 0.002, 0)


class FakeDraft:
    """Drafts k tokens; its second Propose fails (the draft went down), and
    its re-open then takes PREFILL_S."""

    name = "draft"
    info = None

    def __init__(self):
        self.proposes = 0
        self.opens = 0

    async def open(self, request, timeout):
        self.opens += 1
        if self.opens > 1:
            await asyncio.sleep(PREFILL_S)
        return f"d{self.opens}", CallCost(0.0, 1)

    async def close(self, session_id, timeout):
        pass

    async def propose(self, session_id, keep, append, k, timeout, **kwargs):
        self.proposes += 1
        if self.proposes == 2:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the draft went down")
        await asyncio.sleep(0.001)
        return [draft_pb2.ProposeResponse(index=i, token_id=5, compute_micros=200) for i in range(k)], \
            CallCost(0.001, 10)


class Recording:
    """A fixed k = 2 that keeps what it is told."""

    name = "recording"

    def __init__(self):
        self.seen = []

    def next_k(self):
        return 2

    def observe(self, obs):
        self.seen.append(obs)

    def min_confidence(self):
        return 0.0


def test_a_session_opened_between_rounds_is_not_learned_as_round_overhead():
    async def main():
        target, draft, policy = FakeTarget(), FakeDraft(), Recording()
        spec = RequestSpec(prompt=[1, 2, 3], max_tokens=40, temperature=0, top_k=0, top_p=1.0, seed=1,
                           eos_ids=frozenset(), speculate=True)
        request = SpeculativeRequest(spec, policy, target, target, draft, LoopSettings(draft_retry_s=0.0))
        tokens = [t async for chunk in request.run() for t in chunk]
        request.close()
        return tokens, request, policy, draft

    tokens, request, policy, draft = asyncio.run(asyncio.wait_for(main(), 30))
    assert len(tokens) == 40 and draft.opens == 2  # the draft was re-opened mid-request
    assert request.stats.prefill_time_s >= PREFILL_S
    assert max(obs.overhead_s for obs in policy.seen) < PREFILL_S / 2, [round(o.overhead_s, 3) for o in policy.seen]


class _PlainGate(Gate):
    def speculate(self, active):
        return False

    def plain_now(self, active):
        return False


class _FlakyTarget(FakeTarget):
    """Its third Verify fails UNAVAILABLE (the target went away)."""

    def __init__(self, gate):
        self.gate = gate
        self.calls = 0

    async def verify(self, item, timeout):
        from specdec.errors import Unavailable

        self.calls += 1
        if self.calls == 3:
            raise Unavailable("the target went away")
        return await super().verify(item, timeout)


class _Lease:
    """A recovery that re-opens on the same fake target."""

    def __init__(self, target):
        import types

        self.client = self.batcher = target
        self.replica = types.SimpleNamespace(address="replica")

    async def reopen(self, request, deadline, cause, open_on):
        return await open_on(self.client, request, 5.0)

    async def settle_move(self):
        pass


class _DeadDraft(FakeDraft):
    async def propose(self, *args, **kwargs):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "down")


def test_a_round_run_again_after_a_target_recovery_is_counted_once():
    """The plain, fallback and pipelined counts were added before the
    round's Verify; one that failed UNAVAILABLE ran again after the recovery
    and counted twice (plain_rounds 11 of 10 rounds)."""
    def run(gate, draft):
        async def main():
            target = _FlakyTarget(gate)
            spec = RequestSpec(prompt=[1, 2, 3], max_tokens=10, temperature=0, top_k=0, top_p=1.0, seed=1,
                               eos_ids=frozenset(), speculate=True)
            request = SpeculativeRequest(spec, Recording(), target, target, draft,
                                         LoopSettings(draft_retry_s=100.0), lease=_Lease(target))
            async for _ in request.run():
                pass
            request.close()
            await asyncio.sleep(0.01)
            return request.stats

        return asyncio.run(asyncio.wait_for(main(), 30))

    gated = run(_PlainGate(), FakeDraft())
    assert gated.target_recoveries == 1 and gated.plain_rounds == gated.rounds
    draft_down = run(Gate(), _DeadDraft())
    assert draft_down.target_recoveries == 1 and draft_down.fallback_rounds == draft_down.rounds
