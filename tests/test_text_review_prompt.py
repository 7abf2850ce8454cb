"""orchestrator/prompt.py: what is tokenized on the event loop, and the
bound on a text's length before it is tokenized."""
from __future__ import annotations

import asyncio
import sys
import threading
import unicodedata

import pytest

from orchestrator.prompt import NORMALIZATION_SLACK, prompt_tokens
from orchestrator.tokenizer import TextTokenizer
from specdec.v1 import orchestrator_pb2 as pb
from tests.test_tokenizer import bos_tokenizer


@pytest.fixture(scope="module")
def text_tokenizer(tmp_path_factory) -> TextTokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    bos_tokenizer().save_pretrained(directory)
    return TextTokenizer.from_directory(directory)


def test_normalization_shrinks_a_text_by_no_more_than_the_slack():
    """A text is refused unread when it has more than NORMALIZATION_SLACK
    characters per token of the longest kind. Normalized (NFC, NFKC), a text
    keeps at least one character for every NORMALIZATION_SLACK, since no
    composed character stands for more code points: U+1F82 "ᾂ" stands for
    four (the module's docstring said three, which would allow a slack of 3)."""
    longest = max(len(unicodedata.normalize("NFD", chr(c)))
                  for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000)
    assert longest == 4 <= NORMALIZATION_SLACK
    decomposed = unicodedata.normalize("NFD", "\u1f82" * 100)
    assert len(decomposed) == 400
    assert len(unicodedata.normalize("NFC", decomposed)) == len(unicodedata.normalize("NFKC", decomposed)) == 100


def chat_request(n: int, content: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content=content) for _ in range(n)]))


def tokenized_where(request, tokenizer) -> tuple[list[int], set[str]]:
    """The request's prompt ids, and on which threads its chat was tokenized."""
    threads = set()

    class Recording:
        chat_template = tokenizer.chat_template

        def get_vocab(self):
            return tokenizer.get_vocab()

        def apply_chat_template(self, *args, **kwargs):
            threads.add(threading.get_ident())
            return tokenizer.apply_chat_template(*args, **kwargs)

    async def main():
        return await prompt_tokens(request, Recording(), len(tokenizer), 10**9), threading.get_ident()

    ids, loop_thread = asyncio.run(main())
    return ids, {"loop" if thread == loop_thread else "worker" for thread in threads}


def test_a_chat_of_many_short_messages_is_tokenized_off_the_event_loop(text_tokenizer):
    """Only the messages' contents counted toward INLINE_CHARS: 20,000 empty
    messages (160 kB on the wire, far under gRPC's 4 MB) went through the
    chat template and the tokenizer on the event loop, freezing every other
    stream for 0.8 s on the dev VM (100,000: 2.7 s), before the prompt was
    refused for its length. Each message now counts for its template's
    text too."""
    ids, where = tokenized_where(chat_request(20_000), text_tokenizer)
    assert len(ids) > 20_000 and where == {"worker"}
    ids, where = tokenized_where(chat_request(3, "hello"), text_tokenizer)  # a usual chat: inline
    assert ids == text_tokenizer.apply_chat_template([{"role": "user", "content": "hello"}] * 3,
                                                     add_generation_prompt=True)
    assert where == {"loop"}
