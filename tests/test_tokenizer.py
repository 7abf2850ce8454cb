"""The orchestrator's tokenizer (orchestrator/tokenizer.py) gives what
transformers' gives, and the orchestrator runs without torch."""
from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from orchestrator.tokenizer import TextTokenizer, load_tokenizer
from specdec.fuzz import system as fuzz
from specdec.processes import read_port, role_env, spawn_role, stop_processes, wait_serving
from tests.harness import running_system

TEXTS = ["def f(x):\n    return x * 2\n", "héllo wörld ☃ 日本語 🎉 “quoted”", "  leading  and   runs\t\ttabs\n\n\n",
         "1234567890 3.14159", "<eos> in the text <eos>", "", " ", "the quick brown fox " * 40, "don't . , !"]
CHATS = [[{"role": "user", "content": "hello"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"},
          {"role": "assistant", "content": "return x"}, {"role": "user", "content": "again <eos>"}]]


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE whose post-processor adds <s> (as Llama's does), so
    add_special_tokens changes the ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}" \
                         "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    return fast


def assert_same(ours: TextTokenizer, theirs) -> None:
    """Every call the orchestrator makes gives the same ids and text."""
    assert ours.eos_token_id == theirs.eos_token_id and len(ours) == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == list(theirs(text, add_special_tokens=special)["input_ids"]), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (text, skip)
    for chat in CHATS:
        for generation_prompt in (True, False):
            expected = theirs.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=True)
            expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
            assert ours.apply_chat_template(chat, add_generation_prompt=generation_prompt) == expected
            assert ours.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False) == \
                theirs.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False)


@pytest.mark.parametrize("make", [fuzz.tokenizer, bos_tokenizer], ids=["chat-template", "bos-post-processor"])
def test_a_saved_tokenizer_reads_as_transformers_reads_it(make, tmp_path):
    make().save_pretrained(tmp_path)
    ours = TextTokenizer.from_directory(tmp_path)
    assert ours is not None and ours.chat_template
    assert_same(ours, AutoTokenizer.from_pretrained(str(tmp_path)))


def test_a_chat_template_in_the_config_is_read_when_no_template_file_exists(tmp_path):
    """Older directories keep the template in tokenizer_config.json: a string,
    or a list of named ones of which "default" is used."""
    made = bos_tokenizer()
    made.save_pretrained(tmp_path)
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for entry in (template, [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}]):
        config["chat_template"] = entry
        config_file.write_text(json.dumps(config))
        ours = TextTokenizer.from_directory(tmp_path)
        assert ours.chat_template == template
        assert_same(ours, AutoTokenizer.from_pretrained(str(tmp_path)))


def test_a_directory_without_tokenizer_json_is_no_text_tokenizer(tmp_path):
    assert TextTokenizer.from_directory(tmp_path) is None
    assert not TextTokenizer(Tokenizer(models.BPE()), {}).chat_template
    with pytest.raises(ValueError, match="no chat template"):
        TextTokenizer(Tokenizer(models.BPE()), {}).apply_chat_template(CHATS[0])


def test_the_orchestrator_loads_a_text_tokenizer_from_a_model_directory(tmp_path):
    fuzz.tokenizer().save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), TextTokenizer)
    assert load_tokenizer("") is None


@pytest.mark.real_models
def test_the_default_pairs_tokenizer_reads_as_transformers_reads_it():
    from specdec.models.cache import locate
    from specdec.models.catalog import DEFAULT_PAIR

    try:
        where, _ = locate(DEFAULT_PAIR.target)
    except LookupError:
        pytest.skip("the default pair is not cached (specd models fetch)")
    ours = load_tokenizer(DEFAULT_PAIR.target)
    assert isinstance(ours, TextTokenizer)
    assert_same(ours, AutoTokenizer.from_pretrained(where))


@pytest.mark.slow
def test_an_orchestrator_process_without_torch_serves_text_and_chat_as_one_with_transformers_tokenizer(tmp_path):
    """`specd serve orchestrator` with an importable `torch` that refuses to
    load: the orchestrator starts, and its text, chat and stop-string
    requests give what an orchestrator with transformers' tokenizer gives."""
    tok = fuzz.tokenizer()
    tok.save_pretrained(tmp_path / "tokenizer")
    blocker = tmp_path / "blocker" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("the orchestrator imported torch")\n')
    env = role_env(extra={"PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])})
    requests = [dict(prompt="hello world", max_tokens=12, temperature=0), dict(prompt=CHATS[1], max_tokens=12, temperature=0),
                dict(prompt="def f(x):", max_tokens=16, stop=["o"], temperature=0),
                dict(prompt=CHATS[0], max_tokens=10, temperature=0.8, seed=7)]
    with running_system(fuzz.engine(0, tok), fuzz.engine(1, tok), tokenizer=tok) as s:
        orchestrator = spawn_role("orchestrator", ["--target", f"127.0.0.1:{s.target.port}",
                                                   "--draft", f"127.0.0.1:{s.draft.port}",
                                                   "--tokenizer", str(tmp_path / "tokenizer")], tmp_path, env)
        try:
            port = read_port(orchestrator, timeout_s=60)
            wait_serving(port, [orchestrator.proc], timeout_s=60)
            from orchestrator.client import Client

            with Client(f"127.0.0.1:{port}", timeout_s=60) as client:
                for request in requests:
                    kwargs = {key: value for key, value in request.items() if key != "prompt"}
                    ours, reference = client.complete(request["prompt"], **kwargs), s.client.complete(
                        request["prompt"], **kwargs)
                    assert (ours.token_ids, ours.text) == (reference.token_ids, reference.text), request
                    assert ours.token_ids
        finally:
            stop_processes([orchestrator.proc], grace_s=10)
    log = orchestrator.log_path.read_text()
    assert "imported torch" not in log
    assert "objects from start-up frozen out of garbage collection" in log  # specdec/heap.py, once SERVING
