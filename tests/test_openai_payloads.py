"""The HTTP front door's pure parts: a golden payload pins the response shape
(vLLM's `metrics.speculative_decoding` names included), the stream's final
chunks, the request translation onto GenerateRequest, and the error mapping."""
from __future__ import annotations

import grpc
import pytest

from orchestrator.openai_api import responses, translate
from orchestrator.openai_api.app import validation_error
from orchestrator.openai_api.config import HttpConfig
from orchestrator.openai_api.errors import HTTP_STATUS, api_error
from orchestrator.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from specdec import errors
from specdec.cli.main import build_parser
from specdec.config import from_args
from specdec.v1 import orchestrator_pb2 as pb

# Four rounds under an adaptive policy: k = 4 accepting 3, k = 3 accepting 1,
# k = 3 accepting 0, then a fallback round (the draft was down): 4 + 2 + 1 + 1
# = 8 tokens, 3 speculative steps, 10 drafted, 4 accepted.
STATS = pb.GenerateStats(
    prompt_tokens=5, completion_tokens=8, rounds=4, proposed_tokens=10, accepted_tokens=4, acceptance_rate=0.4,
    mean_tokens_per_round=2.0, k=pb.KSummary(min=0, max=4, mean=2.5, histogram=[1, 0, 0, 2, 1]),
    time_to_first_token_s=0.25, tokens_per_second=16.0, duration_s=0.5, finish_reason=pb.FINISH_REASON_EOS,
    seed=2**63 + 5, accepted_per_position=[2, 1, 1], fallback_rounds=1, draft_time_s=0.125, verify_time_s=0.25,
    target_compute_time_s=0.1875, wire_bytes=2048, draft_model="draft-m", target_model="target-m", policy="adaptive",
    round_trips=9, pipelined_rounds=0, draft_compute_time_s=0.0625, rejected_rounds=3,
    acceptance_histogram=[1, 1, 0, 1, 0], k_per_round=[4, 3, 3, 0], prefill_time_s=0.03125)

GOLDEN_METRICS = {
    "speculative_decoding": {
        # vLLM's names (per-request speculative decoding metrics)
        "mean_acceptance_length": 1 + 4 / 3,
        "draft_acceptance_rate": 0.4,
        "acceptance_histogram": [1, 1, 0, 1, 0],
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 4,
        "num_draft_tokens": 10,
        "num_spec_tokens": 4,
        # ours
        "policy": "adaptive",
        "rounds": 4,
        "k_per_round": [4, 3, 3, 0],
        "fallback_rounds": 1,
        "plain_rounds": 0,
        "recoveries": 3,
        "pipelined_rounds": 0,
        "accepted_per_position": [2, 1, 1],
    },
    "specdec": {
        "prompt_tokens": 5, "completion_tokens": 8, "rounds": 4, "proposed_tokens": 10, "accepted_tokens": 4,
        "acceptance_rate": 0.4, "mean_tokens_per_round": 2.0,
        "k": {"min": 0, "max": 4, "mean": 2.5, "histogram": [1, 0, 0, 2, 1]},
        "time_to_first_token_s": 0.25, "tokens_per_second": 16.0, "duration_s": 0.5,
        "finish_reason": "FINISH_REASON_EOS", "seed": 9223372036854775813, "accepted_per_position": [2, 1, 1],
        "fallback_rounds": 1, "draft_time_s": 0.125, "verify_time_s": 0.25, "target_compute_time_s": 0.1875,
        "wire_bytes": 2048, "draft_model": "draft-m", "target_model": "target-m", "policy": "adaptive",
        "round_trips": 9, "pipelined_rounds": 0, "draft_compute_time_s": 0.0625, "rejected_rounds": 3, "target_recoveries": 0,
        "acceptance_histogram": [1, 1, 0, 1, 0], "k_per_round": [4, 3, 3, 0], "prefill_time_s": 0.03125,
        "plain_rounds": 0,
    },
}
USAGE = {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


def test_golden_completion_payload():
    head = responses.Head(id="cmpl-1", created=1700000000, model="target-m", chat=False)
    assert responses.body(head, "hello", STATS) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "target-m",
        "choices": [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE, "metrics": GOLDEN_METRICS,
    }


def test_golden_chat_payload():
    head = responses.Head(id="chatcmpl-1", created=1700000000, model="target-m", chat=True)
    assert responses.body(head, "hi", STATS) == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "target-m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": USAGE, "metrics": GOLDEN_METRICS,
    }


def test_golden_stream_chunks_metrics_ride_the_last_one():
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    plain = responses.Head(id="chatcmpl-1", created=1, model="m", chat=True)
    assert responses.role_chunk(plain) == {**base, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    assert responses.text_chunk(plain, "x") == {**base, "choices": [
        {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}
    finish = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert responses.final_chunks(plain, STATS) == [{**base, "choices": [finish], "metrics": GOLDEN_METRICS}]
    with_usage = responses.Head(id="chatcmpl-1", created=1, model="m", chat=True, include_usage=True)
    assert responses.final_chunks(with_usage, STATS) == [
        {**base, "choices": [finish], "usage": None},
        {**base, "choices": [], "usage": USAGE, "metrics": GOLDEN_METRICS},
    ]
    completion = responses.Head(id="cmpl-1", created=1, model="m", chat=False)
    assert responses.text_chunk(completion, "x")["choices"] == [
        {"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]
    assert responses.sse({"a": 1}) == 'data: {"a":1}\n\n' and responses.DONE == "data: [DONE]\n\n"


def test_no_speculative_step_gives_zero_rates_and_an_empty_histogram():
    stats = pb.GenerateStats(rounds=3, completion_tokens=3, k_per_round=[0, 0, 0], acceptance_histogram=[0],
                             policy="none")
    spec = translate.speculative_decoding(stats)
    assert spec["num_spec_steps"] == 0 and spec["mean_acceptance_length"] == 0.0
    assert spec["draft_acceptance_rate"] == 0.0 and spec["num_spec_tokens"] == 0


# ------------------------------------------------------------ translation

def test_completion_request_translation():
    body = CompletionRequest(prompt="hi", max_tokens=7, temperature=0, top_p=0.5, top_k=-1, seed=3, stop="x",
                             speculation={"policy": "goodput", "num_draft_tokens": 3, "pipeline": True,
                                          "draft_min_confidence": 0.25})
    request = translate.completion_request(body, "rid")
    assert request.prompt == "hi" and request.max_tokens == 7 and request.request_id == "rid"
    assert request.HasField("temperature") and request.temperature == 0 and request.top_p == 0.5
    assert request.top_k == 0 and request.seed == 3 and list(request.stop) == ["x"]
    assert request.speculation.policy == "goodput" and request.speculation.num_draft_tokens == 3
    assert request.speculation.HasField("pipeline") and request.speculation.pipeline
    assert request.speculation.HasField("draft_min_confidence") and request.speculation.draft_min_confidence == 0.25
    defaults = translate.completion_request(CompletionRequest(prompt=[[5, 6]]))
    assert list(defaults.prompt_token_ids.token_ids) == [5, 6]
    assert defaults.max_tokens == translate.COMPLETIONS_DEFAULT_MAX_TOKENS
    assert not defaults.HasField("temperature") and not defaults.HasField("seed")
    assert not defaults.speculation.HasField("pipeline") and not defaults.speculation.HasField("draft_min_confidence")
    with pytest.raises(ValueError):  # pydantic's ValidationError: a 400 naming the field
        CompletionRequest(prompt="hi", speculation={"draft_min_confidence": 1.5})


def test_chat_request_translation():
    body = ChatCompletionRequest(messages=[{"role": "developer", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}],
                                 max_completion_tokens=9, n=1, logprobs=False, tool_choice="none")
    request = translate.chat_request(body)
    assert [(m.role, m.content) for m in request.messages.messages] == [("system", "be brief"), ("user", "ab")]
    assert request.max_tokens == 9
    assert translate.chat_request(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])).max_tokens == 0


@pytest.mark.parametrize("field, value", [("n", 2), ("n", True), ("presence_penalty", 0.1), ("logit_bias", {"1": 2}),
                                          ("echo", True), ("logprobs", 0), ("suffix", "x")])
def test_unsupported_completion_fields_are_refused_by_name(field, value):
    with pytest.raises(translate.BadField) as err:
        translate.completion_request(CompletionRequest(prompt="x", **{field: value}))
    assert err.value.param == field and field in str(err.value)
    assert api_error(err.value).status == 400 and api_error(err.value).param == field


def test_neutral_values_of_unsupported_fields_pass():
    translate.completion_request(CompletionRequest(prompt="x", n=1, echo=False, best_of=1, presence_penalty=0.0,
                                                   frequency_penalty=0, logit_bias={}, user="u"))


# ----------------------------------------------------------------- errors

@pytest.mark.parametrize("exc, status, type_", [
    (errors.InvalidArgument("x"), 400, "invalid_request_error"),
    (errors.FailedPrecondition("x"), 400, "invalid_request_error"),
    (errors.Unauthenticated("x"), 401, "authentication_error"),
    (errors.NotFound("x"), 404, "not_found_error"),
    (errors.ResourceExhausted("x"), 429, "rate_limit_error"),
    (errors.Unavailable("x"), 503, "service_unavailable_error"),
    (errors.DeadlineExceeded("x"), 504, "timeout_error"),
    (RuntimeError("a bug"), 500, "server_error"),
])
def test_core_errors_map_to_http_statuses(exc, status, type_):
    error = api_error(exc)
    assert (error.status, error.type) == (status, type_)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    if status == 500:
        assert "a bug" not in error.message  # no internals leak to the caller


def test_every_grpc_status_has_an_http_status():
    assert set(HTTP_STATUS) == set(grpc.StatusCode) - {grpc.StatusCode.OK}
    assert HTTP_STATUS[grpc.StatusCode.UNAUTHENTICATED] == 401


def test_validation_errors_name_the_field():
    error = validation_error([{"type": "extra_forbidden", "loc": ("body", "max_token"), "msg": "x"},
                              {"type": "missing", "loc": ("body", "prompt"), "msg": "y"}])
    assert (error.status, error.param, error.message) == (400, "max_token", "unknown field 'max_token' (and 1 more error)")


def test_http_flags_of_serve_orchestrator():
    args = build_parser().parse_args(["serve", "orchestrator", "--http-port", "8123", "--served-model-name", "m"])
    cfg = from_args(HttpConfig, args)
    assert cfg.enabled and cfg.http_port == 8123 and cfg.served_model_name == "m"
    assert not from_args(HttpConfig, build_parser().parse_args(["serve", "orchestrator"])).enabled
    with pytest.raises(ValueError):
        HttpConfig(http_port=70000).validate()


def test_max_tokens_and_max_completion_tokens_must_agree_when_both_are_sent():
    from orchestrator.openai_api.translate import BadField
    from orchestrator.openai_api.schemas import ChatCompletionRequest
    from orchestrator.openai_api.translate import chat_request

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadField, match="max_tokens and max_completion_tokens differ"):
        chat_request(ChatCompletionRequest(messages=messages, max_tokens=5, max_completion_tokens=6))
    assert chat_request(ChatCompletionRequest(messages=messages, max_tokens=6, max_completion_tokens=6)).max_tokens == 6
    assert chat_request(ChatCompletionRequest(messages=messages, max_completion_tokens=7)).max_tokens == 7
