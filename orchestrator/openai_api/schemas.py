"""Request bodies of the OpenAI-compatible API, as pydantic models.

Unknown fields are refused (a typo such as `max_token` is a 400, not a silent
default). OpenAI fields this server cannot honour (logprobs, echo, n > 1,
tools, penalties, ...) are declared loosely here and refused by
`translate.check_unsupported` unless they carry their neutral value, with a
message naming the field. Extensions: `top_k` (vLLM's; 0 or -1 disables) and
`speculation` (gRPC's SpeculationOptions).
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict

# Integers travel on as protobuf int32 fields (GenerateRequest); a larger one
# must be a 400 naming its field here, not an overflow further on.
INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
# Token ids and switches take their own JSON type only: pydantic's lax mode
# read `"prompt": [true, false]` as the token ids [1, 0] and `"stream": "yes"`
# as true. (A number like 5.0 where an integer is due stays accepted.)
TokenId = Annotated[int, Strict(), Field(ge=-(2**31), le=INT32_MAX)]
Switch = Annotated[bool, Strict()]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculationOptions(_Strict):
    """Per-request speculation (extension), as gRPC's SpeculationOptions."""

    policy: str = ""  # fixed | adaptive | goodput; empty: the server's
    num_draft_tokens: int = Field(0, ge=0, le=INT32_MAX)  # fixed k or the starting k; 0: the server's
    min_draft_tokens: int = Field(0, ge=0, le=INT32_MAX)  # adaptive bounds; 0: the server's
    max_draft_tokens: int = Field(0, ge=0, le=INT32_MAX)
    disable: Switch = False  # the target alone (the baseline)
    pipeline: Switch | None = None  # pipelined drafting; null: the server's
    draft_min_confidence: float | None = Field(None, ge=0, le=1)  # end drafting when unsure; null: the server's


class StreamOptions(_Strict):
    include_usage: Switch | None = False


class GenerationRequest(_Strict):
    """Fields both endpoints share."""

    model: str | None = None  # null: the served model
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = None  # null: 1.0; 0: greedy
    top_p: float | None = None
    top_k: Int32 | None = None  # extension; 0 or -1: off
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)  # OpenAI's and vLLM's int64, or our uint64
    stop: str | list[str] | None = None
    stream: Switch | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    speculation: SpeculationOptions | None = None  # extension
    # Accepted only at their neutral value (translate.UNSUPPORTED).
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: Any = None
    logprobs: Any = None
    best_of: Any = None
    suffix: Any = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: Any = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    metadata: dict[str, str] | None = None  # for stored completions: accepted, not used
    service_tier: str | None = None  # accepted, not used
    parallel_tool_calls: Switch | None = None  # meaningless without tools: accepted
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    store: Any = None
    web_search_options: Any = None
