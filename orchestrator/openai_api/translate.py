"""OpenAI requests onto the gRPC contract, and the request's statistics back
into OpenAI's `usage` and vLLM's per-request `metrics` (pure functions).

The speculative-decoding metrics use the names of vLLM's per-request metrics,
so tools written for vLLM (AIPerf, ...) read ours. Their meaning when k varies
from round to round (adaptive and goodput policies):

- a **speculative step** is a round that verified at least one drafted token;
  rounds without drafts (fallback rounds while the draft is down, a request's
  last token, speculation disabled) are not steps;
- `num_spec_steps`: speculative steps;
- `num_draft_tokens`: drafted tokens verified, over all steps (the sum of k);
- `num_accepted_draft_tokens`: drafted tokens the target accepted;
- `draft_acceptance_rate` = accepted / drafted (0 without steps);
- `mean_acceptance_length` = 1 + accepted / steps: tokens emitted per step,
  the recovered or bonus token included (0 without steps);
- `acceptance_histogram[j]`: steps that accepted exactly j drafted tokens,
  j = 0..num_spec_tokens (a step with k = 2 that accepted both and one with
  k = 4 that accepted two share bin 2); it sums to num_spec_steps;
- `num_spec_tokens`: the largest k used (vLLM's fixed k).

Ours, beside them: `policy`, `rounds`, `k_per_round` (drafted tokens verified
in each round, 0 for a round without drafts), `fallback_rounds`, `plain_rounds`
(rounds the speculation gate decoded plainly), `recoveries` (steps that ended
in a rejection, hence in the target's recovered token), `pipelined_rounds`, `accepted_per_position`. `metrics.specdec` carries the
whole GenerateStats of the gRPC stream.
"""
from __future__ import annotations

from specdec.errors import InvalidArgument
from specdec.v1 import orchestrator_pb2 as pb

from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions

# OpenAI fields this server cannot honour, and the values that mean "not used".
UNSUPPORTED_COMMON = {"n": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                      "logit_bias": (None, {})}
UNSUPPORTED_COMPLETION = {"echo": (None, False), "logprobs": (None,), "best_of": (None, 1), "suffix": (None, "")}
UNSUPPORTED_CHAT = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
                    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
                    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
                    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "store": (None, False),
                    "web_search_options": (None,)}
_WHY = {"n": "this server returns one choice per request: n must be 1",
        "best_of": "this server returns one choice per request: best_of must be 1"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASON = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop"}


class BadField(InvalidArgument):
    """INVALID_ARGUMENT about one field (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _text(value: str, param: str) -> str:
    """A string that protobuf can carry: JSON may spell a lone UTF-16
    surrogate ("\\ud800"), which is no Unicode character and has no UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadField(param, f"{param} is not valid Unicode: a lone surrogate at position {exc.start}") from None
    return value


def check_unsupported(body: GenerationRequest, table: dict) -> None:
    for name, neutral in table.items():
        value = getattr(body, name)
        if not _is_neutral(value, neutral):
            why = _WHY.get(name, f"{name} is not supported by this server")
            raise BadField(name, f"{why} (got {name}={value!r})")


def _is_neutral(value, neutral: tuple) -> bool:
    if value is None or isinstance(value, bool):  # True is not 1 here
        return any(v is value for v in neutral)
    return any(v is not None and not isinstance(v, bool) and v == value for v in neutral)


# ------------------------------------------------------------- requests

def completion_request(body: CompletionRequest, request_id: str = "") -> pb.GenerateRequest:
    check_unsupported(body, {**UNSUPPORTED_COMMON, **UNSUPPORTED_COMPLETION})
    request = _common(body, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, request_id)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadField("prompt", f"one prompt per request, got a batch of {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = _text(prompt, "prompt")
    else:
        if not prompt:
            raise BadField("prompt", "the prompt is empty")
        request.prompt_token_ids.CopyFrom(pb.TokenIds(token_ids=prompt))
    return request


def chat_request(body: ChatCompletionRequest, request_id: str = "") -> pb.GenerateRequest:
    check_unsupported(body, {**UNSUPPORTED_COMMON, **UNSUPPORTED_CHAT})
    if body.max_tokens and body.max_completion_tokens and body.max_tokens != body.max_completion_tokens:
        raise BadField("max_completion_tokens", "max_tokens and max_completion_tokens differ: send one")
    request = _common(body, body.max_completion_tokens or body.max_tokens or 0, request_id)
    request.messages.CopyFrom(pb.ChatMessages(messages=[_message(i, m) for i, m in enumerate(body.messages)]))
    return request


def _common(body: GenerationRequest, max_tokens: int, request_id: str) -> pb.GenerateRequest:
    if body.stream_options is not None and not body.stream:
        raise BadField("stream_options", "stream_options is only allowed when stream is true")
    top_k = body.top_k or 0
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    stop = [_text(s, "stop") for s in ([body.stop] if isinstance(body.stop, str) else list(body.stop or []))]
    request = pb.GenerateRequest(max_tokens=max_tokens, top_k=top_k, stop=stop, request_id=request_id)
    if body.temperature is not None:
        request.temperature = body.temperature
    if body.top_p is not None:
        request.top_p = body.top_p
    if body.seed is not None:
        request.seed = body.seed % 2**64  # a negative int64 seed (vLLM takes any) as its uint64 bits
    if body.speculation is not None:
        s = body.speculation
        request.speculation.CopyFrom(pb.SpeculationOptions(
            policy=_text(s.policy, "speculation.policy"), num_draft_tokens=s.num_draft_tokens,
            min_draft_tokens=s.min_draft_tokens,
            max_draft_tokens=s.max_draft_tokens, disable=s.disable))
        if s.pipeline is not None:
            request.speculation.pipeline = s.pipeline
        if s.draft_min_confidence is not None:
            request.speculation.draft_min_confidence = s.draft_min_confidence
    return request


def _message(index: int, message) -> pb.ChatMessage:
    where = f"messages[{index}]"
    role = ROLES.get(message.role)
    if role is None:
        raise BadField(f"{where}.role", f"{where}.role {message.role!r} is not supported: use system, developer, "
                                        "user or assistant (tool calls are not supported)")
    for name in ("name", "tool_calls", "tool_call_id", "function_call", "refusal"):
        if getattr(message, name) is not None:
            raise BadField(f"{where}.{name}", f"{where}.{name} is not supported by this server")
    content = message.content
    if content is None:
        raise BadField(f"{where}.content", f"{where}.content is missing")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadField(f"{where}.content[{j}]", f"{where}.content[{j}]: only text parts "
                                                        f"({{\"type\": \"text\", \"text\": ...}}) are supported")
            parts.append(part["text"])
        content = "".join(parts)
    return pb.ChatMessage(role=role, content=_text(content, f"{where}.content"))


# ----------------------------------------------------------- statistics

def finish_reason(stats: pb.GenerateStats) -> str:
    """OpenAI's words: an EOS token and a stop string both end with "stop"."""
    return FINISH_REASON.get(stats.finish_reason, "stop")


def usage(stats: pb.GenerateStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def speculative_decoding(stats: pb.GenerateStats) -> dict:
    """vLLM's per-request speculative-decoding metrics, then ours (see the
    module docstring for their meaning under adaptive k)."""
    histogram = list(stats.acceptance_histogram)
    steps = sum(histogram)
    drafted, accepted = stats.proposed_tokens, stats.accepted_tokens
    return {
        "mean_acceptance_length": 1 + accepted / steps if steps else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": max(stats.k_per_round, default=0),
        "policy": stats.policy,
        "rounds": stats.rounds,
        "k_per_round": list(stats.k_per_round),
        "fallback_rounds": stats.fallback_rounds,
        "plain_rounds": stats.plain_rounds,
        "recoveries": stats.rejected_rounds,
        "pipelined_rounds": stats.pipelined_rounds,
        "accepted_per_position": list(stats.accepted_per_position),
    }


def metrics(stats: pb.GenerateStats) -> dict:
    """The response's top-level `metrics` object."""
    return {"speculative_decoding": speculative_decoding(stats), "specdec": plain(stats)}


def plain(message) -> dict:
    """A message as plain JSON values: numbers stay numbers (protobuf's JSON
    mapping would quote 64-bit ints), enums by name, every field present."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and not field.is_repeated:
            value = plain(value)
        elif field.is_repeated:
            value = list(value)
        elif field.enum_type is not None:
            value = field.enum_type.values_by_number[value].name
        out[field.name] = value
    return out
