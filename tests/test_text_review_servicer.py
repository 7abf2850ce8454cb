"""The text chunks of a Generate call through servicer._generate (with the
speculative loop replaced by scripted rounds, and end to end): chunk text
against token ids, stops inside a round of several tokens, the tail flush,
finish reasons."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import servicer as servicer_module
from orchestrator.config import OrchestratorConfig
from orchestrator.reply_relay import merged
from orchestrator.request_stats import RequestStats
from orchestrator.servicer import Backends, OrchestratorServicer
from orchestrator.speculation import LoopSettings
from specdec.v1 import orchestrator_pb2 as pb
from tests.test_detokenizer import byte_level_bpe
from tests.test_generate_text import text_system  # noqa: F401 - the module's fixture, used by name
from tests.test_text_review_stream import byte_level_ids, reference, rounds_of

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_LENGTH: "length"}


class ScriptedLoop:
    """SpeculativeRequest's part that servicer._generate uses: `run()`
    yields the script's rounds, then ends as the script says."""
    script: tuple[list[list[int]], str] = ([], "length")

    def __init__(self, spec, *args, **kwargs):
        self.spec, self.stats, self.finish_reason = spec, RequestStats(), "length"
        self.draft, self.target = None, SimpleNamespace(info=None)
        self.sessions = SimpleNamespace(release_draft=_nothing, pin_draft=lambda *a: None)

    async def run(self):
        rounds, end = self.script
        for tokens in rounds:
            self.stats.rounds += 1
            self.stats.completion_tokens += len(tokens)
            self.stats.k_histogram = [self.stats.rounds]
            yield tokens
        self.finish_reason = end

    def close(self):
        pass


class NoLease:
    client = batcher = None

    def __init__(self, *args):
        pass

    async def release(self):
        pass


async def _nothing():
    pass


@pytest.fixture(scope="module")
def scripted():
    tokenizer = byte_level_bpe()
    backends = Backends(targets=None, drafts=None, tokenizer=tokenizer, settings=LoopSettings(max_context=4096),
                        eos_ids=frozenset(), vocab_size=len(tokenizer))
    service = OrchestratorServicer(OrchestratorConfig(), backends)
    calls = []

    def generate(prompt, rounds, end, stops):
        calls.append(1)
        ScriptedLoop.script = (rounds, end)
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(token_ids=prompt), max_tokens=1000,
                                     stop=stops, speculation=pb.SpeculationOptions(disable=True))

        async def collect():
            span = SimpleNamespace(is_recording=lambda: False)
            return [reply async for reply in service.generate(request, span, None)]
        with pytest.MonkeyPatch.context() as patch:  # only while it runs: other tests run real loops
            patch.setattr(servicer_module, "SpeculativeRequest", ScriptedLoop)
            patch.setattr(servicer_module, "TargetLease", NoLease)
            return asyncio.run(collect())

    yield tokenizer, generate
    assert len(calls) >= 100  # the examples ran


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(st.data(), st.lists(st.integers(1, 7), min_size=1, max_size=6), st.sampled_from(["eos", "length"]))
def test_the_chunks_text_is_the_decode_cut_at_the_earliest_stop(scripted, data, sizes, end):
    tokenizer, generate = scripted
    ids = data.draw(byte_level_ids(tokenizer))
    prompt = tokenizer.encode("say:", add_special_tokens=False)
    text = reference(tokenizer, prompt, ids, [])[0]
    from_text = st.builds(lambda a, n: text[a:a + n], st.integers(0, max(len(text) - 1, 0)), st.integers(1, 4))
    stops = [s for s in data.draw(st.lists(st.one_of(from_text, st.text("ab ☃\ufffd", min_size=1, max_size=3)),
                                           max_size=4)) if s]
    rounds = rounds_of(ids, sizes)
    replies = generate(prompt, rounds, end, stops)
    *chunks, last = replies
    assert last.HasField("stats") and all(reply.HasField("chunk") for reply in chunks)
    expected_text, stopped = reference(tokenizer, prompt, ids, stops)
    assert "".join(c.chunk.text for c in chunks) == expected_text
    assert FINISH[last.stats.finish_reason] == ("stop" if stopped else end)
    # Every round's tokens are reported once, in order, up to the round a stop ended.
    sent = [t for c in chunks for t in c.chunk.token_ids]
    # The relay's merging (of copies: it changes the first) keeps the text and the tokens.
    copies = [pb.GenerateResponse.FromString(reply.SerializeToString()) for reply in replies]
    assert [(r.chunk.text, list(r.chunk.token_ids)) for r in merged(copies)[:-1]] == [(expected_text, sent)] * bool(chunks)
    assert sent == ids[:len(sent)] and last.stats.completion_tokens == len(sent)
    if not stopped:
        assert sent == ids


def test_a_stop_reached_mid_round_reports_no_tokens_past_it(text_system):  # noqa: F811
    s, tok = text_system, text_system.tokenizer
    full = s.client.complete("abc", max_tokens=40, temperature=0)
    stop = full.text[3:6]
    result = s.client.complete("abc", max_tokens=40, temperature=0, stop=[stop])
    assert result.text == full.text[:full.text.index(stop)]
    # One token at a time, generation ends at the token that completes the stop.
    needed = next(n for n in range(1, len(full.token_ids) + 1)
                  if stop in tok.decode(full.token_ids[:n], skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False))
    assert result.token_ids == full.token_ids[:needed]
    assert result.stats.completion_tokens == needed
    st = result.stats  # the drafts accepted past the stop are not counted either
    assert st.accepted_tokens <= st.completion_tokens
    assert sum(st.accepted_per_position) == st.accepted_tokens
    assert sum(j * n for j, n in enumerate(st.acceptance_histogram)) == st.accepted_tokens


def test_drafts_accepted_past_a_stop_are_not_counted(text_system):  # noqa: F811
    """The draft is the target's copy: every draft is accepted, so a stop
    completed early in a round drops accepted drafts, which must leave the
    acceptance counts as they leave completion_tokens."""
    s = text_system
    full = s.client.complete("abc", max_tokens=40, temperature=0, num_draft_tokens=4, policy="fixed")
    cut_drafts = 0
    for i in range(1, 24):
        stop = full.text[i:i + 2]
        if not stop.strip() or "\ufffd" in stop:
            continue
        r = s.client.complete("abc", max_tokens=40, temperature=0, stop=[stop], num_draft_tokens=4, policy="fixed")
        st = r.stats
        assert len(r.token_ids) == st.completion_tokens
        assert st.accepted_tokens <= st.completion_tokens, (stop, st.accepted_tokens, st.completion_tokens)
        assert sum(st.accepted_per_position) == st.accepted_tokens
        assert sum(j * n for j, n in enumerate(st.acceptance_histogram)) == st.accepted_tokens
        cut_drafts += st.rounds * 5 > st.completion_tokens + 1
    assert cut_drafts, "no stop fell early in a round"


def test_cutting_a_rounds_tail_uncounts_the_accepted_drafts_in_it():
    """A round of k=4 that accepted 3 drafts emits 3 drafts and the target's
    own token; a stop after its first draft drops 3 tokens: the target's
    token and 2 accepted drafts."""
    from orchestrator.request_stats import RequestStats

    stats = RequestStats()
    stats.record_round(4, 4)
    stats.record_round(4, 3)
    stats.completion_tokens = 9
    stats.cut_last_round(3)
    assert stats.completion_tokens == 6 and stats.accepted == 5
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.acceptance_histogram == [0, 1, 0, 0, 1]
    stats.cut_last_round(1)  # only the target's own token: nothing accepted leaves
    assert stats.accepted == 5 and stats.completion_tokens == 5
