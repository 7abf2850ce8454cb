"""Busy polling (specdec/busy_poll.py): off unless configured; on, a loop
polls while a reply is due and stops once it came or the limit passed; a
service lingers after a reply until the next call comes; with the lengths of
the waits before, only a wait's end is polled; the lanes and the call
streams use it, and the tokens of a round do not change."""
from __future__ import annotations

import asyncio

import pytest

from specdec import busy_poll
from specdec.rpc.lane_server import LaneServer
from tests.harness import DEADLINE_S
from tests.test_lanes import METHOD, _client, _handle, _request


@pytest.fixture
def polling():
    """Busy polling on (up to 1 s a wait) for the test, off after it."""
    busy_poll.configure(1_000_000)
    yield
    busy_poll.configure(0)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def _poller():
    return busy_poll._pollers.get(asyncio.get_running_loop())


def test_off_by_default_a_wait_polls_nothing():
    async def main():
        reply = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.02, reply.set_result, 1)
        with busy_poll.waiting():
            assert await reply == 1
        busy_poll.linger()
        await asyncio.sleep(0.01)
        return busy_poll.turns()

    assert not busy_poll.enabled()
    assert _run(main()) == 0


def test_a_wait_polls_until_its_reply_comes_and_then_stops(polling):
    async def main():
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        loop.call_later(0.2, reply.set_result, "answer")  # long enough that CPU load cannot starve the polling
        with busy_poll.waiting():
            assert await reply == "answer"
        during = busy_poll.turns()
        await asyncio.sleep(0)  # the turn that sees no wait left
        await asyncio.sleep(0)
        assert not _poller().running
        after = busy_poll.turns()
        await asyncio.sleep(0.02)
        return during, after, busy_poll.turns()

    during, after, later = _run(main())
    assert during > 10  # 200 ms of turns of a few µs each
    assert later == after  # stopped with the wait


def test_a_wait_is_polled_no_longer_than_the_limit():
    busy_poll.configure(5_000)  # 5 ms
    try:
        async def main():
            loop = asyncio.get_running_loop()
            reply = loop.create_future()
            loop.call_later(0.1, reply.set_result, None)
            with busy_poll.waiting():
                await asyncio.sleep(0.05)  # well past the limit, the reply still due
                assert not _poller().running
                stopped_at = busy_poll.turns()
                await reply
            return stopped_at, busy_poll.turns()

        stopped_at, end = _run(main())
        assert stopped_at > 0 and end == stopped_at
    finally:
        busy_poll.configure(0)


def test_a_linger_polls_until_the_next_call_comes(polling):
    async def main():
        busy_poll.linger()
        await asyncio.sleep(0.01)
        assert _poller().running and busy_poll.turns() > 0
        busy_poll.arrived()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return _poller().running

    assert _run(main()) is False


def test_turning_it_off_stops_a_loop_that_polls(polling):
    async def main():
        reply = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, reply.set_result, None)
        with busy_poll.waiting():
            await asyncio.sleep(0.005)
            busy_poll.configure(0)
            await asyncio.sleep(0.005)
            assert not _poller().running
            await reply

    _run(main())


def test_a_wait_expected_to_be_long_sleeps_until_just_before_its_end(polling):
    async def main():
        loop = asyncio.get_running_loop()
        expected = busy_poll.Expected()
        expected.note(0.2)  # such waits took 200 ms lately: sleep ~199.5 ms, then poll
        early = loop.create_future()
        loop.call_later(0.01, early.set_result, None)
        with busy_poll.waiting(expected):
            await early  # came long before the polling was due: nothing polled
        assert busy_poll.turns() == 0
        assert list(expected.recent)[-1] < 0.2  # its length noted: the next wait polls sooner
        expected.recent.clear()
        expected.note(0.05)
        late = loop.create_future()
        loop.call_later(0.1, late.set_result, None)
        with busy_poll.waiting(expected):
            await asyncio.sleep(0.005)
            assert busy_poll.turns() == 0  # still asleep, ~45 ms before the poll is due
            await late
        return busy_poll.turns()

    assert _run(main()) > 0  # polled from ~49.5 ms until the reply at 100 ms


def test_a_linger_expecting_a_long_gap_polls_only_its_end_and_the_call_notes_the_gap(polling):
    async def main():
        expected = busy_poll.Expected()
        expected.note(0.2)
        busy_poll.linger(expected)
        await asyncio.sleep(0.01)
        assert busy_poll.turns() == 0 and not _poller().lingering  # not due for ~190 ms
        busy_poll.arrived(expected)
        assert _poller().linger_timer is None  # the call ended the linger before it began
        gap = list(expected.recent)[-1]
        assert 0.005 < gap < 0.2
        expected.recent.clear()
        expected.note(0.0001)  # shorter than the lead: poll at once
        busy_poll.linger(expected)
        await asyncio.sleep(0.005)
        assert _poller().lingering and busy_poll.turns() > 0
        busy_poll.arrived(expected)

    _run(main())


def test_a_lane_call_polls_on_both_sides_and_answers_as_before(polling):
    """The client polls while its call is out; the server lingers after
    its reply until the next call, which ends the linger."""
    async def main():
        server = LaneServer(METHOD, _handle, *_lane_types(), "fake", 1 << 20)
        await server.start("127.0.0.1", 0)
        client = _client(server.port)
        try:
            # The handler answers after 200 ms: long enough that CPU load cannot starve the polling.
            reply = await client(_request("slow-200", keep=5), 5)
            assert [d.token_id for d in reply.drafts] == [5]
            assert busy_poll.turns() > 10  # one loop: the client's wait and the server's linger alike
            assert _poller().lingering  # the server lingers after its reply
            reply = await client(_request("a", keep=9), 5)
            assert [d.token_id for d in reply.drafts] == [9]
        finally:
            await client.close()
            server.close()
            await server.wait_closed(1)

    _run(main())


def _lane_types():
    from specdec.v1 import draft_pb2

    return draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply


def test_rounds_with_every_role_polling_give_the_target_only_greedy_tokens(polling):
    from tests.conftest import tiny_engine, tiny_model
    from tests.harness import running_system
    from tests.test_orchestrator import greedy_reference, perturbed

    target = tiny_model(seed=0, init_range=0.3)
    draft = perturbed(target, 0.15, seed=1)
    prompt = [5, 9, 14, 3, 22, 7]
    reference = greedy_reference(target, prompt, 20)
    for lanes in (True, False):  # the lanes, then the gRPC call streams
        with running_system(tiny_engine(model=target), tiny_engine(model=draft), lanes=lanes) as system:
            result = system.client.complete(prompt, max_tokens=20, temperature=0, num_draft_tokens=3)
            assert result.token_ids == reference[:len(result.token_ids)]
            assert len(result.token_ids) == 20 or reference[len(result.token_ids)] == 2
            assert result.stats.rounds > 1
            for loop in (system.loop, system.draft_loop, system.target_loop):
                assert busy_poll._pollers[loop.loop].turns > 0  # the orchestrator waited, each service lingered


def test_auto_polls_only_with_the_models_on_a_gpu_and_cpus_to_spare(monkeypatch):
    monkeypatch.setattr(busy_poll, "usable_cpus", lambda: busy_poll.AUTO_MIN_CPUS)
    assert busy_poll.choose(busy_poll.AUTO, models_on_gpu=True)[0] == busy_poll.AUTO_US
    assert busy_poll.choose(busy_poll.AUTO, models_on_gpu=False)[0] == 0  # the models compute on these CPUs
    assert busy_poll.choose(0, models_on_gpu=True)[0] == 0  # asked: off
    assert busy_poll.choose(3000, models_on_gpu=False)[0] == 3000  # asked: on
    monkeypatch.setattr(busy_poll, "usable_cpus", lambda: busy_poll.AUTO_MIN_CPUS - 1)
    assert busy_poll.choose(busy_poll.AUTO, models_on_gpu=True)[0] == 0
    try:
        assert busy_poll.configure_auto(busy_poll.AUTO, models_on_gpu=True) == 0 and not busy_poll.enabled()
        monkeypatch.setattr(busy_poll, "usable_cpus", lambda: 16)
        assert busy_poll.configure_auto(busy_poll.AUTO, models_on_gpu=True) == busy_poll.AUTO_US
        assert busy_poll.enabled()
    finally:
        busy_poll.configure(0)


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "250000 100000\n"}, 2.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
    ({}, None),
])
def test_a_cgroups_cpu_quota_is_read_in_either_version(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert busy_poll._cgroup_quota(str(tmp_path)) == quota


def test_usable_cpus_are_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(busy_poll.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(busy_poll, "_cgroup_quota", lambda: None)
    assert busy_poll.usable_cpus() == 16
    monkeypatch.setattr(busy_poll, "_cgroup_quota", lambda: 2.5)  # a pod limited to 2.5 CPUs
    assert busy_poll.usable_cpus() == 2
    monkeypatch.setattr(busy_poll, "_cgroup_quota", lambda: 0.5)
    assert busy_poll.usable_cpus() == 1


def test_the_orchestrator_counts_its_models_on_a_gpu_only_when_every_replica_says_so():
    from types import SimpleNamespace

    from orchestrator.servicer import Backends
    from specdec.v1 import common_pb2

    def pool(*devices):
        return SimpleNamespace(replicas={f"r{i}": SimpleNamespace(client=SimpleNamespace(
            info=common_pb2.ModelInfo(device=d) if d is not None else None)) for i, d in enumerate(devices)})

    def backends(targets, drafts):
        return Backends(targets=targets, drafts=drafts, tokenizer=None, settings=None, eos_ids=frozenset(),
                        vocab_size=0)

    assert backends(pool("cuda:0", "cuda:1"), pool("cuda")).on_gpus()
    assert backends(pool("cuda:0"), None).on_gpus()  # no draft: the target alone
    assert not backends(pool("cuda:0"), pool("cpu")).on_gpus()
    assert not backends(pool("cuda:0", "cpu"), pool("cuda:0")).on_gpus()
    assert not backends(pool("cuda:0", None), pool("cuda:0")).on_gpus()  # a replica not yet described
    assert not backends(pool(), None).on_gpus()
    ngram = SimpleNamespace(replicas={"n": SimpleNamespace(client=SimpleNamespace(
        info=common_pb2.ModelInfo(device="cpu", backend="ngram")))})
    assert backends(pool("cuda:0"), ngram).on_gpus()  # an n-gram drafter runs no model
    assert not backends(pool("cpu"), ngram).on_gpus()


def test_paused_stops_polling_within_its_block_and_restores_the_setting_after(polling):
    async def main():
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        loop.call_later(0.02, reply.set_result, 1)
        with busy_poll.paused():
            assert not busy_poll.enabled()
            with busy_poll.waiting():
                assert await reply == 1
            paused_turns = busy_poll.turns()
        assert busy_poll.enabled()
        late = loop.create_future()
        loop.call_later(0.02, late.set_result, 1)
        with busy_poll.waiting():
            await late
        return paused_turns, busy_poll.turns()

    paused_turns, after = _run(main())
    assert paused_turns == 0 and after > 0


def test_a_setting_made_while_paused_takes_effect_when_the_pause_ends():
    try:
        busy_poll.configure(50_000)
        with busy_poll.paused():
            busy_poll.configure(0)
            assert not busy_poll.enabled()
        assert not busy_poll.enabled()
        with busy_poll.paused():
            with busy_poll.paused():
                busy_poll.configure(20_000)
            assert not busy_poll.enabled()  # the outer pause still holds
        assert busy_poll.enabled()
    finally:
        busy_poll.configure(0)
