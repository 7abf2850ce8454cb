"""Pairs whose embedding rows are padded differently (Qwen2.5-0.5B: 151936 rows,
7B: 152064, one tokenizer of 151665 tokens), on a tiny pair that carries a real
tokenizer built in the test: the tokenizer check runs, padded ids are never
emitted even when their logits are the largest, and a pair with another
tokenizer is refused."""
from __future__ import annotations

import grpc
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from orchestrator.replica_checks import check_compatible, usable_size_of
from specdec.engine.config import EngineConfig
from specdec.engine.engine import ExtendItem, ModelEngine
from specdec.engine.loading import tokenizer_fingerprint
from specdec.engine.vocab import IdSpace, known_token_count, mask_padding_, usable_size, usable_size_of_directory
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import common_pb2
from tests.conftest import tiny_config
from tests.harness import running_system

TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello again", "def f(x): return x + 1"]


def trained_tokenizer(text=TEXT, size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here (no download): a real tokenizer of `size` tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def saved_model(directory, tokenizer, rows: int, seed: int):
    """A tiny random Qwen2 with `rows` embedding rows, saved with `tokenizer`."""
    torch.manual_seed(seed)
    config = tiny_config("qwen2", vocab_size=rows, init_range=0.3)
    config.eos_token_id = None  # run to max_tokens
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def load_engine(directory) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model=directory, dtype="float32", max_kv_bytes=1 << 28))


def boost_padding(engine: ModelEngine, amount: float = 1e4):
    """Make the padded rows' logits the largest: without the mask every token would be one."""
    bias = torch.zeros(engine.vocab_size)
    bias[engine.usable_vocab_size:] = amount
    return engine.model.lm_head.register_forward_hook(lambda _module, _inputs, out: out + bias)


def masked_greedy_reference(model, prompt, n, usable):
    """Target-only greedy decoding over the ids the tokenizer knows."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1, :usable].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def tokenizer():
    return trained_tokenizer()


@pytest.fixture(scope="module")
def padded_pair(tokenizer, tmp_path_factory):
    """(draft, target) engines: rows = the tokenizer rounded up to 64, and that + 128."""
    root = tmp_path_factory.mktemp("padded")
    draft_rows = round_up(len(tokenizer), 64)
    draft = load_engine(saved_model(root / "draft", tokenizer, draft_rows, seed=1))
    target = load_engine(saved_model(root / "target", tokenizer, draft_rows + 128, seed=0))
    # What loading made of it (transformers may add a token, e.g. Qwen2's
    # <|endoftext|>): the same for both, and what the services use.
    assert len(draft.tokenizer) == len(target.tokenizer) >= len(tokenizer)
    return draft, target


# ------------------------------------------------------------------ pure helpers


def test_usable_size_is_the_tokenizer_capped_by_the_rows(tokenizer):
    assert usable_size(64, None) == 64
    assert usable_size(1000, tokenizer) == len(tokenizer)
    assert usable_size(len(tokenizer) - 5, tokenizer) == len(tokenizer) - 5


def test_gguf_placeholder_tokens_are_not_tokens():
    """A GGUF pads its tokenizer with "[PAD<id>]" up to the row count: those
    neither count nor change the fingerprint."""
    plain, padded = trained_tokenizer(), trained_tokenizer()
    n = len(plain)
    padded.add_tokens([f"[PAD{i}]" for i in range(n, n + 7)])
    assert len(padded) == n + 7 and padded.convert_tokens_to_ids(f"[PAD{n + 6}]") == n + 6
    assert known_token_count(padded) == n
    assert tokenizer_fingerprint(padded, 0) == tokenizer_fingerprint(plain, 0)
    plain.add_tokens(["[PAD3]"])  # a real token that only looks like one: its id is not 3
    assert known_token_count(plain) == n + 1


def test_mask_padding_sets_the_padded_columns_to_minus_inf():
    logits = torch.randn(2, 3, 10)
    before = logits.clone()
    assert mask_padding_(logits, 7) is logits
    assert torch.equal(logits[..., :7], before[..., :7])
    assert torch.isneginf(logits[..., 7:]).all()
    untouched = torch.randn(4, 10)
    assert torch.equal(mask_padding_(untouched.clone(), 10), untouched)


def info(name, rows, fingerprint, usable=0):
    return common_pb2.ModelInfo(model_name=name, vocab_size=rows, tokenizer_fingerprint=fingerprint,
                                usable_vocab_size=usable, backend="model")


def test_pairs_are_judged_by_tokenizer_not_by_rows():
    check_compatible(info("qwen-0.5b", 151936, "abc", 151665), info("qwen-7b", 152064, "abc", 151665))
    with pytest.raises(FailedPrecondition, match="'a'.*'b'.*different tokenizers"):
        check_compatible(info("a", 151936, "abc", 151665), info("b", 151936, "xyz", 151665))
    # Without tokenizers the ids are all there is: equal sizes, as before.
    check_compatible(info("a", 128, "untokenized-vocab-128"), info("b", 128, "untokenized-vocab-128"))
    with pytest.raises(FailedPrecondition, match="vocabulary size 128 != target's 192"):
        check_compatible(info("a", 128, "untokenized-vocab-128"), info("b", 192, "untokenized-vocab-192"))
    # Without tokenizers, two models that name one family's ids pair whatever their padding
    # (synthetic Qwen2.5 0.5B and 7B on a machine with no cached tokenizer) ...
    check_compatible(info("a", 151936, "untokenized-qwen2.5-151665", 151665),
                     info("b", 152064, "untokenized-qwen2.5-151665", 151665))
    # ... but not with a model that names none, nor when no side says anything (an old service).
    with pytest.raises(FailedPrecondition, match="vocabulary size 151936 != target's 152064"):
        check_compatible(info("a", 151936, "untokenized-qwen2.5-151665", 151665),
                         info("b", 152064, "untokenized-vocab-152064"))
    with pytest.raises(FailedPrecondition, match="vocabulary size 128 != target's 192"):
        check_compatible(info("a", 128, ""), info("b", 192, ""))
    # A model with fewer rows than its tokenizer has tokens cannot read all of the other's ids.
    with pytest.raises(FailedPrecondition, match=r"\[0, 150000\) and \[0, 151665\)"):
        check_compatible(info("a", 150000, "abc", 150000), info("b", 152064, "abc", 151665))
    assert usable_size_of(info("old", 128, "x")) == 128  # a service older than the field


# ------------------------------------------------------------------ the engine


def test_a_padded_model_emits_and_reads_only_the_tokenizers_ids(padded_pair):
    draft, target = padded_pair
    usable = len(target.tokenizer)
    assert target.vocab_size == draft.vocab_size + 128 and draft.vocab_size - usable < 64
    assert draft.info.usable_vocab_size == target.info.usable_vocab_size == usable
    assert draft.info.tokenizer_fingerprint == target.info.tokenizer_fingerprint
    hook = boost_padding(target)
    try:
        session = target.open_session([5, 6, 7])
        logits = target.extend([ExtendItem(session.id, None, [8], num_logits=2)])[0]
        assert logits.shape == (2, target.vocab_size)
        assert torch.isneginf(logits[:, usable:]).all() and torch.isfinite(logits[:, :usable]).all()
        with pytest.raises(InvalidArgument, match=f"token id {usable} outside the vocabulary"):
            target.append_tokens(session.id, [usable])  # a padded row: refused, not just unused
        with pytest.raises(InvalidArgument, match="outside the vocabulary"):
            target.open_session([3, target.vocab_size - 1])
        target.close(session.id)
    finally:
        hook.remove()


def test_a_saved_models_usable_size_comes_from_its_tokenizer_files(padded_pair, tmp_path):
    _, target = padded_pair  # its name is its directory
    assert usable_size_of_directory(target.name, target.vocab_size) == len(target.tokenizer)
    target.model.save_pretrained(tmp_path)  # no tokenizer files: every row
    assert usable_size_of_directory(str(tmp_path), target.vocab_size) == target.vocab_size


# ------------------------------------------------------------------ end to end


def test_padded_pair_generates_the_targets_greedy_output(padded_pair):
    draft, target = padded_pair
    tokenizer = target.tokenizer
    usable = len(tokenizer)
    prompt = tokenizer("hello world, the quick", add_special_tokens=True)["input_ids"]
    with running_system(target, draft, tokenizer=tokenizer) as s:
        result = s.client.complete(prompt, max_tokens=24, temperature=0, num_draft_tokens=4)
        assert result.token_ids == masked_greedy_reference(target.model, prompt, 24, usable)
        assert result.stats.proposed_tokens > 0, "the draft took part"
        text = s.client.complete("hello world", max_tokens=8, temperature=0)
        assert len(text.token_ids) == 8
        with pytest.raises(grpc.RpcError) as err:
            s.client.complete([3, usable], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"outside the vocabulary [0, {usable})" in err.value.details()


def test_sampled_runs_never_emit_a_padded_id_even_when_it_is_the_most_likely(padded_pair):
    draft, target = padded_pair
    tokenizer = target.tokenizer
    usable = len(tokenizer)
    hooks = [boost_padding(draft), boost_padding(target)]
    try:
        with running_system(target, draft, tokenizer=tokenizer) as s:
            emitted, accepted = [], 0
            for seed in range(6):
                for temperature, top_k in ((1.0, 0), (1.5, 50)):
                    r = s.client.complete([5, 6, 7, 8], max_tokens=12, temperature=temperature, top_k=top_k,
                                          seed=seed, num_draft_tokens=3)
                    emitted += r.token_ids
                    accepted += r.stats.accepted_tokens
            greedy = s.client.complete([5, 6, 7, 8], max_tokens=12, temperature=0, num_draft_tokens=3)
            emitted += greedy.token_ids
        assert len(emitted) == 13 * 12
        assert max(emitted) < usable
    finally:
        for hook in hooks:
            hook.remove()


def test_a_pair_with_another_tokenizer_is_refused(padded_pair, tmp_path):
    _, target = padded_pair
    other = trained_tokenizer(["completely different text, other merges", "zebra quartz jukebox"])
    draft = load_engine(saved_model(tmp_path / "other", other, round_up(len(other), 64), seed=2))
    with pytest.raises(FailedPrecondition, match="different tokenizers") as err:
        with running_system(target, draft):
            pass
    assert str(tmp_path / "other") in str(err.value) and "target" in str(err.value)


def test_models_of_one_family_without_a_tokenizer_emit_only_the_familys_ids():
    """A synthetic model with no cached tokenizer (models/synth.py) names its
    family's ids: both engines of a pair padded differently announce the same
    fingerprint and usable size, and never emit or read a padded id."""
    space = IdSpace("fam", 180)
    engines = []
    for rows, seed in ((192, 0), (256, 1)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=rows), dtype=torch.float32)
        engines.append(ModelEngine(model, EngineConfig(dtype="float32", max_kv_bytes=1 << 24), id_space=space))
    draft, target = engines
    check_compatible(*(info(e.name, e.info.vocab_size, e.info.tokenizer_fingerprint, e.info.usable_vocab_size)
                       for e in engines))
    assert draft.info.tokenizer_fingerprint == target.info.tokenizer_fingerprint == "untokenized-fam-180"
    assert draft.info.usable_vocab_size == target.info.usable_vocab_size == 180
    for engine in engines:
        hook = boost_padding(engine)
        try:
            session = engine.open_session([5, 6, 7])
            logits = engine.extend([ExtendItem(session.id, None, [8], num_logits=1)])[0]
            assert torch.isneginf(logits[:, 180:]).all() and int(logits.argmax()) < 180
            with pytest.raises(InvalidArgument, match="token id 180 outside the vocabulary"):
                engine.append_tokens(session.id, [180])
            engine.close(session.id)
        finally:
            hook.remove()
