"""Generate with a real (trained-in-test) tokenizer: text prompts, chat
messages, streamed text, stop strings and finish reasons."""
from __future__ import annotations

import grpc
import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.conftest import tiny_engine, tiny_model
from tests.harness import running_system
from tests.test_detokenizer import byte_level_bpe
from tests.test_orchestrator import greedy_reference

# It refuses a conversation that opens with the assistant, as many real
# templates refuse forms they were not trained on (raise_exception).
CHAT_TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}"
                 "{{ raise_exception('a conversation opens with a system or user message') }}{% endif %}"
                 "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def text_system():
    tokenizer = byte_level_bpe()
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab = len(tokenizer)
    target = tiny_model(seed=0, vocab_size=vocab, init_range=0.3)
    target.config.eos_token_id = target.generation_config.eos_token_id = None  # stop strings end it
    draft = tiny_model(seed=0, vocab_size=vocab, init_range=0.3)
    with running_system(tiny_engine(model=target), tiny_engine(model=draft), tokenizer=tokenizer) as system:
        system.tokenizer = tokenizer
        system.target_model = target
        yield system


def test_text_prompt_streams_the_decoded_text(text_system):
    s, tok = text_system, text_system.tokenizer
    chunks = list(s.client.generate("héllo wörld ☃", max_tokens=24, temperature=0))
    ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    assert len(ids) == 24
    prompt_ids = tok("héllo wörld ☃", add_special_tokens=True)["input_ids"]
    assert ids == greedy_reference(s.target_model, prompt_ids, 24)
    assert text == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if "\ufffd" not in text:  # random tokens may spell invalid UTF-8; then the full decode has it too
        assert all("\ufffd" not in c.text for c in chunks)
    assert s.client.last_stats.finish_reason == pb.FINISH_REASON_LENGTH


def test_chat_messages_use_the_chat_template(text_system):
    s, tok = text_system, text_system.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    result = s.client.complete(messages, max_tokens=8, temperature=0)
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt_ids, "keys"):
        prompt_ids = prompt_ids["input_ids"]
    assert result.stats.prompt_tokens == len(prompt_ids)
    assert result.token_ids == greedy_reference(s.target_model, prompt_ids, 8)


def test_messages_the_chat_template_refuses_are_an_invalid_argument(text_system):
    with pytest.raises(grpc.RpcError) as err:
        text_system.client.complete([{"role": "assistant", "content": "hi"}], max_tokens=4, temperature=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("the model's chat template refuses these messages: "
                                   "a conversation opens with a system or user message")
    assert text_system.client.complete([{"role": "user", "content": "hi"}], max_tokens=4).token_ids


def test_stop_string_truncates_the_text_and_ends_with_stop(text_system):
    s = text_system
    full = s.client.complete("abc", max_tokens=40, temperature=0)
    assert len(full.text) > 6
    stop = full.text[3:6]
    result = s.client.complete("abc", max_tokens=40, temperature=0, stop=[stop])
    assert result.text == full.text[: full.text.index(stop)]
    assert result.stats.finish_reason == pb.FINISH_REASON_STOP
    assert len(result.token_ids) < 40
