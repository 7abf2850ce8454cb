"""Incremental detokenization on real tokenizers built in-process (no hub download):
a byte-level BPE (GPT-2 / Qwen style) and a SentencePiece-like Metaspace BPE with
byte fallback (Llama style). Both split multi-byte characters across tokens."""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from orchestrator.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

SENTENCES = [
    "héllo wörld ☃ 日本語 🎉",
    "the quick brown fox jumps over the lazy dog.",
    "hello world, hello again! naïve café 😀",
]
SAMPLES = SENTENCES + [
    " leading space and  double  spaces ",
    "日本語🎉☃é",  # multi-byte characters back to back
    "unknown words: zebra quartz ß ∑ 🦄",
]


@functools.cache
def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A tiny vocabulary keeps most multi-byte characters split into byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)


def metaspace_bpe(decoder: str) -> PreTrainedTokenizerFast:
    """SentencePiece-like: "▁" marks word starts, characters outside the vocabulary
    fall back to <0xNN> byte tokens, and the first token's leading space is dropped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in "▁abcdefghijklmnopqrstuvwxyz.,!:":
        vocab[char] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"),
              ("o", "r"), ("▁", "t"), ("▁t", "h"), ("▁th", "e")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    if decoder == "llama":  # what Llama / Mistral tokenizer.json files use
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


METASPACE = {name: metaspace_bpe(name) for name in ("llama", "metaspace")}
TOKENIZERS = {"byte_level": byte_level_bpe(), **{f"sp_{k}": v for k, v in METASPACE.items()}}


@pytest.fixture(params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids, chunk_sizes, prompt=None, skip_special_tokens=True):
    """Feed ids in chunks of the given sizes (cycled); return the list of outputs."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    outputs, i, n = [], 0, 0
    while i < len(ids):
        size = chunk_sizes[n % len(chunk_sizes)]
        outputs.append(detok.add(ids[i:i + size]))
        i, n = i + size, n + 1
    outputs.append(detok.flush())
    assert detok.text == "".join(outputs)
    return outputs


def test_the_test_tokenizers_split_characters_across_tokens(tokenizer):
    ids = encode(tokenizer, "日本語 🎉")
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    assert tokenizer.decode(ids) == "日本語 🎉"


@pytest.mark.parametrize("text", SAMPLES)
def test_one_token_at_a_time_equals_the_full_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    outputs = stream(tokenizer, ids, [1])
    assert not any(REPLACEMENT_CHAR in out for out in outputs)
    assert "".join(outputs) == tokenizer.decode(ids, skip_special_tokens=True)


def test_partial_character_is_held_back_then_released():
    tokenizer = byte_level_bpe()
    ids = encode(tokenizer, "☃")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["☃"]


def test_a_chunk_ending_in_a_partial_character_emits_its_whole_characters():
    tokenizer = byte_level_bpe()
    ids = encode(tokenizer, "hello ☃")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:-1]) == "hello "
    assert detok.add(ids[-1:]) == "☃"


def test_flush_returns_an_unfinished_character_as_replacement():
    tokenizer = byte_level_bpe()
    ids = encode(tokenizer, "ok 🎉")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    assert REPLACEMENT_CHAR not in detok.add(ids)
    assert detok.flush().endswith(REPLACEMENT_CHAR)
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode(ids)


def test_sentencepiece_first_token_drops_its_space_but_later_tokens_keep_it():
    tokenizer = METASPACE["llama"]
    ids = encode(tokenizer, "hello world the end")
    assert tokenizer.decode(ids[1:2]) == "w"  # "▁w" alone loses its space
    assert "".join(stream(tokenizer, ids, [1])) == "hello world the end"


@pytest.mark.parametrize("prompt_text, generated_text", [
    ("the quick", " brown fox"),
    ("日本語", " 🎉 hello"),
    ("hello", " wörld"),
])
def test_a_prompt_gives_context_to_the_first_generated_tokens(tokenizer, prompt_text, generated_text):
    prompt = encode(tokenizer, prompt_text)
    ids = encode(tokenizer, prompt_text + generated_text)
    assert ids[:len(prompt)] == prompt
    generated = ids[len(prompt):]
    expected = tokenizer.decode(ids)[len(tokenizer.decode(prompt)):]
    outputs = stream(tokenizer, generated, [1], prompt=prompt)
    assert "".join(outputs) == expected == generated_text


def test_a_prompt_ending_mid_window_on_a_split_character():
    # Five tokens back from the end of the prompt lands inside the first "🎉"'s bytes,
    # and byte fallback decodes a run of byte tokens as one unit: a window starting
    # there would turn every following byte token into U+FFFD.
    tokenizer = METASPACE["llama"]
    ids = encode(tokenizer, "x🎉🎉日本 hello")
    prompt, generated = ids[:10], ids[10:]
    assert tokenizer.decode(prompt) == "x🎉🎉"
    outputs = stream(tokenizer, generated, [1], prompt=prompt)
    assert not any(REPLACEMENT_CHAR in out for out in outputs)
    assert "".join(outputs) == "日本 hello"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = encode(tokenizer, "hello") + [tokenizer.eos_token_id] + encode(tokenizer, "the end")
    for skip in (True, False):
        outputs = stream(tokenizer, ids, [1], skip_special_tokens=skip)
        assert "".join(outputs) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.eos_token not in "".join(stream(tokenizer, ids, [1]))


def test_empty_add_returns_nothing():
    detok = IncrementalDetokenizer(byte_level_bpe())
    assert detok.add([]) == "" and detok.flush() == "" and detok.text == ""


text_strategy = st.text(st.sampled_from(list("abehlorw ,.!éö☃日本語🎉😀ß∑")), max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(TOKENIZERS)), text_strategy, st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_random_chunking_never_emits_partial_characters(name, text, chunk_sizes):
    tokenizer = TOKENIZERS[name]
    ids = encode(tokenizer, text)
    outputs = stream(tokenizer, ids, chunk_sizes)
    assert not any(REPLACEMENT_CHAR in out for out in outputs)
    assert "".join(outputs) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(3, 299), max_size=25), st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_arbitrary_token_sequences_match_the_full_decode(ids, chunk_sizes):
    # Random ids can form invalid UTF-8, so only the concatenation is checked here.
    tokenizer = byte_level_bpe()
    assert "".join(stream(tokenizer, ids, chunk_sizes)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_long_run_of_bytes_that_are_no_utf8_streams_as_replacements_with_bounded_work():
    """A model may emit continuation bytes with no lead byte: each decodes to
    U+FFFD for good. They stream as such once more tokens are held than a
    character spans; held back for good, every add decoded the whole held run
    again at each of its ends (cubic: 800 of them took 3 s on the real
    tokenizer). Each add now decodes a bounded window a bounded number of times."""
    tokenizer = byte_level_bpe()
    orphan = tokenizer.convert_tokens_to_ids(_byte_chars()[0x80])  # the byte 0x80 alone: a continuation byte
    assert tokenizer.decode([orphan] * 3) == REPLACEMENT_CHAR * 3
    decoded = []

    class Counting:
        def decode(self, ids, **kwargs):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    detok = IncrementalDetokenizer(Counting())
    detok.add(encode(tokenizer, "x = b'"))
    streamed = [detok.add([orphan] * 5) for _ in range(160)]  # 800 of them
    assert all(streamed[1:]), "the run streams as it comes"
    assert max(decoded) <= 20 and len(decoded) <= 8 * 161, (max(decoded), len(decoded))
    detok.add(encode(tokenizer, "☃'"))
    detok.flush()
    assert detok.text == "x = b'" + REPLACEMENT_CHAR * 800 + "☃'"


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table, which the byte-level pre-tokenizer writes tokens in."""
    chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in chars}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
