"""Response bodies and stream chunks of the OpenAI-compatible API (pure:
the id, time and model come in, so a golden test can pin the shapes).

A stream is: (chat: a first chunk with the assistant role), one chunk per
piece of new text, a chunk with the finish_reason, then, with
`stream_options.include_usage`, a chunk with no choices and the usage. The
request's `metrics` ride the last of these, which is always sent; then
`data: [DONE]`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.v1 import orchestrator_pb2 as pb

from . import translate


@dataclass(frozen=True)
class Head:
    """What every body and chunk of one response repeats."""

    id: str  # cmpl-... or chatcmpl-...
    created: int  # unix seconds
    model: str
    chat: bool
    include_usage: bool = False  # stream_options.include_usage

    def _base(self, streamed: bool) -> dict:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def body(head: Head, text: str, stats: pb.GenerateStats) -> dict:
    """The whole response of a request without `stream`."""
    reason = translate.finish_reason(stats)
    if head.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {**head._base(False), "choices": [choice], "usage": translate.usage(stats),
            "metrics": translate.metrics(stats)}


def _chunk(head: Head, choices: list) -> dict:
    chunk = {**head._base(True), "choices": choices}
    if head.include_usage:
        chunk["usage"] = None  # OpenAI's: null on every chunk but the usage chunk
    return chunk


def _choice(head: Head, text: str | None, reason: str | None, role: bool = False) -> dict:
    if head.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}


def role_chunk(head: Head) -> dict:
    """Chat streams open with the assistant's role, as OpenAI's do."""
    return _chunk(head, [_choice(head, None, None, role=True)])


def text_chunk(head: Head, text: str) -> dict:
    return _chunk(head, [_choice(head, text, None)])


def final_chunks(head: Head, stats: pb.GenerateStats) -> list[dict]:
    """The finish_reason chunk, then (include_usage) the usage chunk; the
    metrics ride the last one."""
    finish = _chunk(head, [_choice(head, None, translate.finish_reason(stats))])
    if not head.include_usage:
        finish["metrics"] = translate.metrics(stats)
        return [finish]
    return [finish, {**head._base(True), "choices": [], "usage": translate.usage(stats),
                     "metrics": translate.metrics(stats)}]


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
