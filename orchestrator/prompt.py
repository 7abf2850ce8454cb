"""A Generate request's prompt as token ids: given as ids, or a text or a
chat's messages tokenized without holding up the other requests.

Tokenizing runs at about 2 MB of text a second on the dev VM. On the event
loop, one 15 MB prompt froze every stream and both doors' health checks for
12-38 s, only to be refused for its length afterwards. So:

- a text that no prompt of `max_context` tokens can be as long as is refused
  before it is tokenized: a token covers at most the longest token's
  characters (`max_token_chars`), and normalization cannot shrink a text
  by more than a further factor of 4 (NFC composes at most four code
  points into one: "ᾂ" is α and three combining marks), which the bound
  allows;
- a long text is tokenized on a worker thread (the `tokenizers` library's
  batch encoding releases the GIL: orchestrator/tokenizer.py), so the loop
  serves the other requests meanwhile; a short one inline, where a thread's
  hand-off would cost more than the tokenizing. A chat's length counts its
  messages' template text too (`MESSAGE_CHARS`): 100,000 empty messages
  (800 kB) held the loop for 2.7 s.
"""
from __future__ import annotations

import asyncio

from jinja2.exceptions import TemplateError

from specdec.errors import InvalidArgument

INLINE_CHARS = 16384  # texts up to this long are tokenized on the loop (~10 ms at most)
# What a chat message costs besides its content, in characters of text: its
# template's text, and rendering it (~40 us a message through Qwen2.5's
# template and tokenizer on the dev VM, as much as ~80 characters of text).
# Counted toward INLINE_CHARS only: a template may render a message as nothing.
MESSAGE_CHARS = 64
NORMALIZATION_SLACK = 4  # how much shorter than its characters a text may tokenize (see the docstring)


async def prompt_tokens(request, tokenizer, vocab_size: int, max_context: int, longest_token: int = 0) -> list[int]:
    """The request's prompt as token ids, each checked against the
    vocabulary. `longest_token`: the tokenizer's `max_token_chars` (0: no
    bound before tokenizing)."""
    which = request.WhichOneof("input")
    if which == "prompt_token_ids":
        tokens = list(request.prompt_token_ids.token_ids)
    elif which in ("prompt", "messages"):
        if tokenizer is None:
            raise InvalidArgument("this server has no tokenizer: send prompt_token_ids")
        chars = len(request.prompt) if which == "prompt" else sum(len(m.content) for m in request.messages.messages)
        if longest_token and chars > NORMALIZATION_SLACK * longest_token * max_context:
            raise InvalidArgument(f"the prompt ({chars} characters) is longer than any prompt within the context "
                                  f"limit of {max_context} tokens can be")
        if chars + (MESSAGE_CHARS * len(request.messages.messages) if which == "messages" else 0) > INLINE_CHARS:
            tokens = await asyncio.to_thread(_tokenize, tokenizer, request, which)
        else:
            tokens = _tokenize(tokenizer, request, which)
    else:
        raise InvalidArgument("the request has no input: set prompt, messages or prompt_token_ids")
    if not tokens:
        raise InvalidArgument("the prompt is empty")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return tokens


def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for (0: unknown): the tokenizer's
    longest vocabulary entry. A byte-level BPE writes a token as one
    character per byte, so its entry is never shorter than its text."""
    try:
        return max(map(len, tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        return 0


def _tokenize(tokenizer, request, which: str) -> list[int]:
    if which == "prompt":
        return list(tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
    messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    if not messages:
        raise InvalidArgument("messages is empty")
    if any(m["role"] not in ("system", "user", "assistant") for m in messages):
        raise InvalidArgument("message roles must be system, user or assistant")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("the target's tokenizer has no chat template: send a plain prompt")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except TemplateError as exc:  # the template's own `raise_exception`: these messages are not its form
        raise InvalidArgument(f"the model's chat template refuses these messages: {exc}") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
