"""The OpenAI-compatible HTTP front door against a live system (tiny models, a
tokenizer trained in the test, every server on 127.0.0.1:0), driven by the
official `openai` client with retries off: the same output as gRPC Generate,
streamed and not, completions and chat, stop strings, usage, the speculative
decoding metrics, clear 400s, and error statuses (429, 503, 504)."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import openai
import pytest

from orchestrator.openai_api.config import HttpConfig
from tests.conftest import tiny_engine, tiny_model
from tests.harness import running_system
from tests.test_detokenizer import byte_level_bpe
from tests.test_generate_text import CHAT_TEMPLATE
from tests.test_orchestrator import _wait_until, perturbed

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def tiny_text_pair():
    """(tokenizer, target, draft): a draft that mostly agrees, no EOS (stop strings and max_tokens end it)."""
    tokenizer = byte_level_bpe()
    tokenizer.chat_template = CHAT_TEMPLATE
    target = tiny_model(seed=0, vocab_size=len(tokenizer), init_range=0.3)
    target.config.eos_token_id = target.generation_config.eos_token_id = None
    draft = perturbed(target, 0.15, seed=1)
    return tokenizer, target, draft


def openai_client(system, timeout_s: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{system.orchestrator.http.port}/v1", api_key="unused",
                         max_retries=0, timeout=timeout_s)


class TargetGate:
    """While shut, holds the target's forward passes (in the target's engine
    thread, at most 60 s) once a request has both its sessions open: a test
    can then act while that request is known to be mid-run."""

    def __init__(self, sessions):
        self._sessions = sessions
        self._open = threading.Event()
        self._open.set()
        self.holding = threading.Event()  # a forward pass is being held

    def forward(self) -> None:
        if not self._open.is_set() and self._sessions() == (1, 1):
            self.holding.set()
            self._open.wait(60)

    @contextmanager
    def shut(self):
        self.holding.clear()
        self._open.clear()
        try:
            yield self
        finally:
            self._open.set()


@pytest.fixture(scope="module")
def http_system():
    tokenizer, target, draft = tiny_text_pair()
    target_engine, draft_engine = tiny_engine(model=target), tiny_engine(model=draft)
    forwards = [0]  # target forward passes: a request run to the end makes many more than a cut one

    def sessions():
        return target_engine.num_sessions, draft_engine.num_sessions

    gate = TargetGate(sessions)

    def on_forward(*_):
        forwards[0] += 1
        gate.forward()

    target_engine.forward_model.register_forward_hook(on_forward)  # the model, or its fused decoder
    with running_system(target_engine, draft_engine, tokenizer=tokenizer, http=HttpConfig(http_port=0)) as system:
        system.tokenizer = tokenizer
        system.sessions = sessions
        system.forwards = lambda: forwards[0]
        system.target_gate = gate
        system.openai = openai_client(system)
        system.model = system.openai.models.list().data[0].id
        yield system
        system.openai.close()


def post(system, path: str, body, headers: dict | None = None, timeout_s: float = 60.0):
    """A raw POST (for what the openai client will not send): (status, parsed JSON or text)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{system.orchestrator.http.port}{path}", data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


# ------------------------------------------------------------- same output

def test_responses_are_not_held_back_by_delayed_acks(http_system):
    # asyncio sets TCP_NODELAY only on sockets created as IPPROTO_TCP; without
    # it a plain response waited ~40 ms for the client's delayed ACK.
    assert http_system.orchestrator.http.socket.proto == socket.IPPROTO_TCP


def test_models_and_health(http_system):
    models = http_system.openai.models.list().data
    assert [m.id for m in models] == ["tiny-llama-0"]
    with urllib.request.urlopen(f"http://127.0.0.1:{http_system.orchestrator.http.port}/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


def test_greedy_completion_equals_grpc_generate(http_system):
    s = http_system
    grpc_result = s.client.complete(PROMPT, max_tokens=24, temperature=0)
    reply = s.openai.completions.create(model=s.model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert reply.choices[0].text == grpc_result.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 24 == len(grpc_result.token_ids)
    assert reply.usage.prompt_tokens == grpc_result.stats.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24
    spec = reply.model_extra["metrics"]["speculative_decoding"]
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] > 0
    assert spec["num_draft_tokens"] == sum(spec["k_per_round"])
    assert reply.model_extra["metrics"]["specdec"]["completion_tokens"] == 24


def test_streamed_completion_equals_the_plain_one(http_system):
    s = http_system
    plain = s.openai.completions.create(model=s.model, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(s.openai.completions.create(model=s.model, prompt=PROMPT, max_tokens=20, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "metrics" in chunks[-1].model_extra  # the final chunk is always sent and carries them
    assert len({c.id for c in chunks}) == 1


def test_token_id_prompt_equals_the_text_prompt(http_system):
    s = http_system
    ids = s.tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    by_text = s.openai.completions.create(model=s.model, prompt=PROMPT, max_tokens=12, temperature=0)
    by_ids = s.openai.completions.create(model=s.model, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_streamed_and_not_equals_grpc_generate(http_system):
    s = http_system
    grpc_result = s.client.complete(MESSAGES, max_tokens=16, temperature=0)
    reply = s.openai.chat.completions.create(model=s.model, messages=MESSAGES, max_completion_tokens=16,
                                             temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == grpc_result.text
    assert reply.usage.prompt_tokens == grpc_result.stats.prompt_tokens
    chunks = list(s.openai.chat.completions.create(model=s.model, messages=MESSAGES, max_tokens=16, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_result.text
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert chunks[-2].choices[0].finish_reason == "length"
    spec = usage_chunk.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_accepted_draft_tokens"] == usage_chunk.model_extra["metrics"]["specdec"]["accepted_tokens"]
    assert all(c.usage is None for c in chunks[:-1])


def test_seeded_sampling_and_speculation_options(http_system):
    s = http_system
    kwargs = dict(model=s.model, prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9, seed=7,
                  extra_body={"top_k": 20, "speculation": {"policy": "adaptive", "num_draft_tokens": 2}})
    first, second = (s.openai.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].text == second.choices[0].text
    stats = first.model_extra["metrics"]["specdec"]
    assert stats["seed"] == 7 and stats["policy"] == "adaptive" and stats["k_per_round"][0] == 2
    off = s.openai.completions.create(**{**kwargs, "extra_body": {"speculation": {"disable": True}}})
    assert off.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] == 0


def test_a_negative_seed_is_its_uint64_bits(http_system):
    """OpenAI's and vLLM's seed is any int64: -1 is taken, as the seed 2^64 - 1."""
    s = http_system
    kwargs = dict(model=s.model, prompt=PROMPT, max_tokens=12, temperature=0.9)
    negative = s.openai.completions.create(seed=-1, **kwargs)
    assert negative.model_extra["metrics"]["specdec"]["seed"] == 2**64 - 1
    assert negative.choices[0].text == s.openai.completions.create(seed=2**64 - 1, **kwargs).choices[0].text


def test_health_answers_head_as_get(http_system):
    request = urllib.request.Request(f"http://127.0.0.1:{http_system.orchestrator.http.port}/health", method="HEAD")
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200 and reply.read() == b""


def test_stop_strings_truncate_and_finish_with_stop(http_system):
    s = http_system
    full = s.openai.completions.create(model=s.model, prompt="abc", max_tokens=40, temperature=0).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    reply = s.openai.completions.create(model=s.model, prompt="abc", max_tokens=40, temperature=0, stop=[stop, "\x00"])
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 40
    streamed = list(s.openai.completions.create(model=s.model, prompt="abc", max_tokens=40, temperature=0,
                                                stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


# -------------------------------------------------------------- bad input

@pytest.mark.parametrize("endpoint, body, param, words", [
    ("completions", dict(n=2), "n", "n must be 1"),
    ("completions", dict(logprobs=1), "logprobs", "not supported"),
    ("completions", dict(echo=True), "echo", "not supported"),
    ("completions", dict(best_of=3), "best_of", "best_of must be 1"),
    ("completions", dict(frequency_penalty=0.5), "frequency_penalty", "not supported"),
    ("completions", dict(max_token=3), "max_token", "unknown field"),
    ("completions", dict(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    ("completions", dict(temperature=-1), None, "temperature"),
    ("completions", dict(top_p=1.5), None, "top_p"),
    ("completions", dict(prompt=["a", "b"]), "prompt", "one prompt per request"),
    ("completions", dict(prompt=[]), "prompt", "empty"),
    ("completions", dict(prompt=[3, 99999]), None, "outside the vocabulary"),
    ("completions", dict(stream_options={"include_usage": True}), "stream_options", "only allowed when stream"),
    ("completions", dict(speculation={"policy": "psychic"}), None, "unknown policy"),
    ("completions", dict(max_tokens=5000), None, "context"),
    ("chat/completions", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
    ("chat/completions", dict(logprobs=True), "logprobs", "not supported"),
    ("chat/completions", dict(messages=[{"role": "tool", "content": "x"}]), "messages.0.role", "not supported"),
    ("chat/completions", dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages.0.content.0", "only text parts"),
    ("chat/completions", dict(messages=[]), "messages", "at least 1"),
    ("chat/completions", dict(messages=[{"role": "assistant", "content": "x"}]), None,
     "chat template refuses these messages: a conversation opens with a system or user message"),
    # Found by the fuzzer (specdec.fuzz): values protobuf cannot carry were a 500.
    ("completions", dict(max_tokens=2**63), "max_tokens", "less than or equal to 2147483647"),
    ("chat/completions", dict(max_completion_tokens=2**31), "max_completion_tokens", "less than or equal"),
    ("completions", dict(top_k=-(2**40)), "top_k", "greater than or equal to -2147483648"),
    ("completions", dict(prompt=[3, 2**40]), None, "prompt"),
    ("completions", dict(speculation={"num_draft_tokens": 2**32}), "speculation.num_draft_tokens", "less than"),
    ("completions", dict(prompt="a\ud800b"), "prompt", "not valid Unicode"),
    ("completions", dict(stop=["\udc80"]), "stop", "not valid Unicode"),
    ("chat/completions", dict(messages=[{"role": "user", "content": "\ud83d"}]), "messages[0].content",
     "not valid Unicode"),
    # Found by review: pydantic's lax mode took these as token ids [1, 0] and as true.
    ("completions", dict(prompt=[True, False]), None, "prompt"),
    ("completions", dict(stream="yes"), "stream", "valid boolean"),
    ("chat/completions", dict(stream=1), "stream", "valid boolean"),
])
def test_unsupported_or_bad_fields_get_a_clear_400(http_system, endpoint, body, param, words):
    base = {"model": http_system.model, "max_tokens": 4}
    base.update({"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    status, error = post(http_system, f"/v1/{endpoint}", {**base, **body})
    assert status == 400, error
    assert error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
    if param:
        assert error["error"]["param"] in (param, param.replace(".0.", "[0]."), "messages[0].role",
                                           "messages[0].content[0]")


def test_the_openai_client_sees_bad_requests_and_unknown_models(http_system):
    s = http_system
    with pytest.raises(openai.BadRequestError) as err:
        s.openai.completions.create(model=s.model, prompt="hi", n=2)
    assert err.value.status_code == 400 and "n must be 1" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        s.openai.completions.create(model="gpt-4o", prompt="hi")
    assert err.value.code == "model_not_found"


def test_malformed_bodies_and_unknown_routes(http_system):
    status, error = post(http_system, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in error["error"]["message"]
    status, error = post(http_system, "/v1/completions", {"max_tokens": 3})
    assert status == 400 and error["error"]["message"] == "prompt is required"
    status, error = post(http_system, "/v1/embeddings", {"input": "x"})
    assert status == 404 and error["error"]["type"] == "not_found_error"


def test_an_empty_body_is_a_400_that_says_so(http_system):
    # `curl -X POST` without -d: the message read "None is required".
    status, error = post(http_system, "/v1/completions", b"")
    assert status == 400 and error["error"]["message"].startswith("the request body is empty")
    assert error["error"]["param"] is None


# ------------------------------------------------------ lifecycle, errors

def test_requests_over_the_http_bound_get_503_at_once_and_health_still_answers(http_system):
    """The gRPC port is bounded (--max-concurrent-rpcs); the HTTP port admitted
    any number of requests, each waiting as long as the one before it."""
    s = http_system
    cfg = s.orchestrator.http.state.cfg
    body = {"model": s.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    cfg.http_max_concurrent_requests = 1
    try:
        replies = []
        with s.target_gate.shut() as gate:
            first = threading.Thread(target=lambda: replies.append(post(s, "/v1/completions", body)))
            first.start()
            assert gate.holding.wait(20), "the first request never reached a verify"
            started = time.monotonic()
            with openai_client(s, timeout_s=10) as client, pytest.raises(openai.InternalServerError) as err:
                client.completions.create(**body)  # a 503 at once, not a wait behind the first
            assert time.monotonic() - started < 5
            assert err.value.status_code == 503 and err.value.code == "unavailable"
            assert "--http-max-concurrent-requests" in err.value.message
            assert err.value.response.headers["retry-after"] == "1"
            url = f"http://127.0.0.1:{s.orchestrator.http.port}/health"
            with urllib.request.urlopen(url, timeout=5) as response:  # probes are not counted
                assert response.status == 200
        first.join(60)
        assert replies and replies[0][0] == 200
        assert post(s, "/v1/completions", body)[0] == 200  # the place was given back
    finally:
        cfg.http_max_concurrent_requests = HttpConfig.http_max_concurrent_requests
    with pytest.raises(ValueError, match="--http-max-concurrent-requests"):
        HttpConfig(http_max_concurrent_requests=0).validate()


def test_a_client_that_disconnects_mid_stream_frees_both_sessions(http_system):
    s = http_system
    before = s.forwards()
    stream = s.openai.completions.create(model=s.model, prompt=PROMPT, max_tokens=900, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            assert s.sessions() == (1, 1)
            break
    stream.close()
    assert _wait_until(lambda: s.sessions() == (0, 0), timeout=20)
    # Ended, not run to its 900 tokens (at most k + 1 = 5 tokens per forward pass).
    assert s.forwards() - before < 900 / 5 / 2


def test_a_plain_request_whose_client_leaves_frees_its_sessions(http_system):
    s = http_system
    before = s.forwards()
    body = {"model": s.model, "prompt": PROMPT, "max_tokens": 900, "temperature": 0}
    with s.target_gate.shut() as gate:
        leaving = http.client.HTTPConnection("127.0.0.1", s.orchestrator.http.port, timeout=20)
        leaving.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        # Mid-run: both sessions open, a target forward held. The client leaves.
        assert gate.holding.wait(20), "the request never reached a verify"
        leaving.close()
        # The server saw it go and ended the request: it could not have run
        # to its end, the target being held.
        assert _wait_until(lambda: s.orchestrator.backends.targets.any().active == 0, timeout=20)
    assert _wait_until(lambda: s.sessions() == (0, 0), timeout=20)
    assert s.forwards() - before < 900 / 5 / 2


@pytest.fixture(scope="module")
def fragile_system():
    """A target with one session, so a second request is over capacity; the
    tests below stop its target last. A request whose target is down looks
    for a replica for target_recovery_s before its 503: 2 s, not 30."""
    tokenizer, target, draft = tiny_text_pair()
    target_engine = tiny_engine(model=target, max_sessions=1)
    with running_system(target_engine, tiny_engine(model=draft), tokenizer=tokenizer,
                        http=HttpConfig(http_port=0), target_recovery_s=2.0) as system:
        system.target_sessions = lambda: target_engine.num_sessions
        system.openai = openai_client(system)
        yield system
        system.openai.close()


def test_over_capacity_is_429_and_a_deadline_is_504(fragile_system):
    s = fragile_system
    stream = s.openai.completions.create(prompt=PROMPT, model="tiny-llama-0", max_tokens=900, temperature=0,
                                         stream=True)
    next(iter(stream))  # the only session is taken
    with pytest.raises(openai.RateLimitError) as err:
        s.openai.completions.create(model="tiny-llama-0", prompt="hi", max_tokens=4)
    assert err.value.status_code == 429 and err.value.code == "resource_exhausted"
    stream.close()
    assert _wait_until(lambda: s.orchestrator.backends.targets.any().active == 0, timeout=20)
    assert _wait_until(lambda: s.target_sessions() == 0, timeout=20)  # the sessions close in the background
    cfg = s.orchestrator.http.state.cfg
    cfg.http_request_timeout_s = 0.05
    try:
        with pytest.raises(openai.APIStatusError) as err:
            s.openai.completions.create(model="tiny-llama-0", prompt=PROMPT, max_tokens=900, temperature=0)
        assert err.value.status_code == 504 and err.value.code == "deadline_exceeded"
    finally:
        cfg.http_request_timeout_s = 600.0


def test_target_down_is_503(fragile_system):
    s = fragile_system
    s.target_loop.run(s.target.stop(0))
    with pytest.raises(openai.InternalServerError) as err:
        s.openai.completions.create(model="tiny-llama-0", prompt="hi", max_tokens=4)
    assert err.value.status_code == 503 and "target" in err.value.message


def test_draining_lets_requests_in_flight_finish_and_refuses_new_ones():
    tokenizer, target, _ = tiny_text_pair()
    with running_system(tiny_engine(model=target), tokenizer=tokenizer, http=HttpConfig(http_port=0)) as s:
        client = openai_client(s)
        replies = []
        worker = threading.Thread(target=lambda: replies.append(client.completions.create(
            model="tiny-llama-0", prompt=PROMPT, max_tokens=300, temperature=0)))
        worker.start()
        try:
            assert _wait_until(lambda: s.orchestrator.backends.targets.any().active == 1)
            s.loop.run(s.orchestrator.http.stop(60))  # returns once the request in flight is done
        finally:
            worker.join(60)
        assert replies and replies[0].usage.completion_tokens > 0  # answered in full, not cut
        assert replies[0].choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.APIConnectionError):
            client.completions.create(model="tiny-llama-0", prompt="hi", max_tokens=2)
        client.close()


def test_a_request_still_running_when_the_drain_grace_ends_gets_a_503_in_openai_json():
    """uvicorn cancels what is left when the grace is over, and answered a
    request not yet answered with its own plain-text 500 (and an "Exception in
    ASGI application" traceback in the log): a shutdown, not our bug; a 503
    tells the client to retry it elsewhere."""
    tokenizer, target, _ = tiny_text_pair()
    engine = tiny_engine(model=target)
    slow = threading.Event()
    engine.forward_model.register_forward_hook(lambda *_: slow.is_set() and time.sleep(0.05))
    with running_system(engine, tokenizer=tokenizer, http=HttpConfig(http_port=0)) as s:
        replies = []
        body = {"model": "tiny-llama-0", "prompt": PROMPT, "max_tokens": 900, "temperature": 0}

        def send():
            connection = http.client.HTTPConnection("127.0.0.1", s.orchestrator.http.port, timeout=60)
            connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            replies.append((response.status, response.getheader("content-type"), response.read().decode()))
            connection.close()

        worker = threading.Thread(target=send)
        slow.set()
        worker.start()
        try:
            assert _wait_until(lambda: s.orchestrator.backends.targets.any().active == 1)
            s.loop.run(s.orchestrator.http.stop(0.2))  # 900 tokens take far longer
        finally:
            worker.join(60)
            slow.clear()
        status, content_type, text = replies[0]
        assert (status, content_type) == (503, "application/json"), replies[0]
        error = json.loads(text)["error"]
        assert error["code"] == "unavailable" and "shut down" in error["message"]
        assert _wait_until(lambda: s.orchestrator.backends.targets.any().active == 0, timeout=20)


@pytest.mark.parametrize("field,value,message", [
    ("prompt", 5, "prompt must be a string, a list of token ids, a list of strings or a list of lists of token ids"),
    ("prompt", [1.5], "prompt must be a string, a list of token ids, a list of strings or a list of lists of token ids"),
    ("stop", [1], "stop must be a string or a list of strings"),
])
def test_a_field_of_several_forms_that_matches_none_says_which_forms(http_system, field, value, message):
    """pydantic reports one error per accepted form ("prompt.str: Input should
    be a valid string (and 3 more errors)"): one message naming them instead."""
    body = {"model": http_system.model, "prompt": "x", "max_tokens": 2, field: value}
    status, reply = post(http_system, "/v1/completions", body)
    assert status == 400 and reply["error"]["message"] == message and reply["error"]["param"] == field, reply
