"""A request's prompt tokenized without holding up the others
(orchestrator/prompt.py), and the HTTP door's body limit
(orchestrator/openai_api/body_limit.py)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from orchestrator.prompt import INLINE_CHARS, max_token_chars, prompt_tokens
from orchestrator.tokenizer import TextTokenizer
from specdec.errors import InvalidArgument
from specdec.v1 import orchestrator_pb2 as pb
from tests.test_tokenizer import bos_tokenizer


@pytest.fixture(scope="module")
def text_tokenizer(tmp_path_factory) -> TextTokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    bos_tokenizer().save_pretrained(directory)
    return TextTokenizer.from_directory(directory)


def test_a_text_longer_than_any_prompt_within_the_context_is_refused_before_it_is_tokenized(text_tokenizer):
    longest = max_token_chars(text_tokenizer)
    assert longest >= max(len(text_tokenizer.decode([i])) for i in range(len(text_tokenizer)))

    class Untouchable:  # the tokenizer, which must not be asked
        def get_vocab(self):
            return text_tokenizer.get_vocab()

        def __call__(self, *args, **kwargs):
            raise AssertionError("tokenized")

    request = pb.GenerateRequest(prompt="x" * (4 * longest * 64 + 1))
    with pytest.raises(InvalidArgument, match="longer than any prompt within the context limit of 64 tokens"):
        asyncio.run(prompt_tokens(request, Untouchable(), len(text_tokenizer), 64, longest))
    # At the bound it is tokenized, and refused (or not) for its tokens, as before.
    request = pb.GenerateRequest(prompt="hello " * 10)
    ids = asyncio.run(prompt_tokens(request, text_tokenizer, len(text_tokenizer), 64, longest))
    assert ids == text_tokenizer("hello " * 10)["input_ids"]


def test_a_long_prompt_is_tokenized_while_the_event_loop_goes_on(text_tokenizer):
    """Tokenized on a worker thread with the GIL released (the tokenizers
    library's batch call): the loop's other tasks keep running meanwhile."""
    text = "def f(x):\n    return x * 2\n" * 40_000  # 1.1 MB: a few tenths of a second to tokenize here
    assert len(text) > INLINE_CHARS
    ticks = []

    async def ticking():
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    async def main():
        ticker = asyncio.ensure_future(ticking())
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        ids = await prompt_tokens(pb.GenerateRequest(prompt=text), text_tokenizer, len(text_tokenizer), 10**9)
        took = time.perf_counter() - start
        ticker.cancel()
        return ids, took, [t for t in ticks if t >= start]

    ids, took, during = asyncio.run(main())
    assert ids == text_tokenizer(text)["input_ids"]
    # The loop ticked through the tokenizing (a frozen loop ticks once, at its end).
    assert len(during) >= max(3, took / 0.005 / 10), (len(during), took)


def test_encode_releases_the_gil(text_tokenizer):
    """What the worker thread relies on: another thread runs while it encodes."""
    text = "héllo wörld ☃ " * 60_000
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        before = count[0]
        text_tokenizer.encode(text)
        during = count[0] - before
        before = count[0]
        time.sleep(0.05)
        alone_50ms = count[0] - before
    finally:
        stop.set()
        spinner.join()
    assert during > alone_50ms / 4, (during, alone_50ms)


def test_an_http_body_over_the_limit_is_refused_with_413_before_it_is_parsed():
    from orchestrator.openai_api.app import FrontDoorState, create_app
    from orchestrator.openai_api.config import HttpConfig
    from specdec.telemetry import NOOP

    app = create_app(FrontDoorState(cfg=HttpConfig(http_max_body_bytes=1000), telemetry=NOOP))

    async def post(chunks: list[bytes], declare: bool) -> tuple[int, dict, int]:
        """POST /v1/completions straight to the ASGI app: (status, JSON body, body chunks it read)."""
        headers = [(b"content-type", b"application/json")]
        if declare:
            headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        pending, read, sent = list(chunks), [0], []

        async def receive():
            if not pending:
                await asyncio.sleep(3600)  # the client waits for the answer
            read[0] += 1
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending)}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 10)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, json.loads(body), read[0]

    status, body, read = asyncio.run(post([b"{" + b" " * 2000 + b"}"], declare=True))
    assert (status, read) == (413, 0), "refused on its Content-Length, unread"
    assert "larger than this server's limit of 1000 bytes" in body["error"]["message"]
    status, body, read = asyncio.run(post([b" " * 400] * 5, declare=False))
    assert (status, read) == (413, 3), "a chunked body: read until it passed the limit"
    status, body, _ = asyncio.run(post([json.dumps({"model": "m", "prompt": "hi"}).encode()], declare=True))
    assert status == 503, body  # within the limit: on to the app (no services here)
