"""The text a client receives is the target's tokens decoded, cut at the
earliest stop string, whatever the rounds' sizes: the detokenizer and the
stop matcher together, as orchestrator/servicer.py drives them, against
that reference, on the in-test tokenizers and (when cached) Qwen's."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from orchestrator.stop import StopMatcher
from tests.test_detokenizer import METASPACE, _byte_chars, byte_level_bpe



@functools.cache
def qwen():
    """The default pair's target tokenizer (Qwen2.5's), when cached."""
    from orchestrator.tokenizer import TextTokenizer
    from specdec.models.cache import locate
    from specdec.models.catalog import DEFAULT_PAIR

    try:
        where, _ = locate(DEFAULT_PAIR.target)
    except LookupError:
        return None
    return TextTokenizer.from_directory(where)


def needs_qwen():
    if qwen() is None:
        pytest.skip("the Qwen tokenizer is not cached")
    return qwen()


@functools.cache
def vocab_of(tokenizer) -> dict[str, int]:
    return tokenizer.get_vocab()


def byte_token(tokenizer, data: bytes) -> int:
    """The id of the byte-level token spelling exactly these bytes."""
    token = vocab_of(tokenizer).get("".join(_byte_chars()[b] for b in data))
    assert token is not None, data
    return token


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def streamed(tokenizer, ids, sizes, prompt=None):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    out, i, n = [], 0, 0
    while i < len(ids):
        size = sizes[n % len(sizes)]
        out.append(detok.add(ids[i:i + size]))
        i, n = i + size, n + 1
    out.append(detok.flush())
    return out


def served(tokenizer, prompt, rounds, stops):
    """The chunks' texts and whether a stop ended it, as servicer._generate
    makes them from the rounds' tokens."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    stop = StopMatcher(stops)
    texts = []
    for tokens in rounds:
        text, stopped = stop.feed(detok.add(tokens))
        texts.append(text)
        if stopped:
            return texts, True
    tail, _ = stop.feed(detok.flush())
    tail += stop.flush()
    texts.append(tail)
    return texts, stop.stopped


def reference(tokenizer, prompt, ids, stops):
    """The generated tokens' text (after the prompt's), cut at the earliest stop."""
    if prompt:
        whole, before = decode(tokenizer, prompt + ids), decode(tokenizer, prompt)
        assert whole.startswith(before)
        text = whole[len(before):]
    else:
        text = decode(tokenizer, ids)
    starts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(starts)], True) if starts else (text, False)


def rounds_of(ids, sizes):
    out, i, n = [], 0, 0
    while i < len(ids):
        out.append(ids[i:i + sizes[n % len(sizes)]])
        i, n = i + sizes[n % len(sizes)], n + 1
    return out


# ---------------------------------------------------------------- the detokenizer


def test_a_valid_text_of_tokens_that_end_inside_characters_streams_unchanged():
    """"日" is e6 97 a5, and the tiny byte-level BPE has the tokens e6 97,
    a5 e6, 97 and a5: [e6 97] then [a5 e6][97] three times then [a5] spells
    "日日日日" with no token ending on a character's end before the last. Held back over
    more tokens than a character spans, the text was emitted anyway, its
    unfinished character as U+FFFD for good: "日\ufffd..." for valid text."""
    tokenizer = byte_level_bpe()
    e6_97, a5_e6, x97, xa5 = (byte_token(tokenizer, b) for b in (b"\xe6\x97", b"\xa5\xe6", b"\x97", b"\xa5"))
    ids = [e6_97, a5_e6, x97, a5_e6, x97, a5_e6, x97, xa5]
    assert decode(tokenizer, ids) == "日日日日"
    for sizes in ([1], [2], [5, 1], [3, 2]):
        out = streamed(tokenizer, ids, sizes)
        assert "".join(out) == "日日日日", sizes
        assert not any(REPLACEMENT_CHAR in text for text in out), sizes


def test_bytes_that_are_no_utf8_after_a_character_finished_mid_token_keep_that_character():
    """f0 9f b2 ac is one character; ac shares its token with e8, which b0
    continues and f0 then breaks (e8 b0: U+FFFD for good). The run held
    back past MAX_CHAR_TOKENS was cut three tokens from its end, inside the
    character, which streamed as U+FFFD."""
    tokenizer = byte_level_bpe()
    ids = [byte_token(tokenizer, b) for b in (b"\xf0\x9f", b"\xb2", b"\xac\xe8", b"\xb0", b"\xf0\x9f", b"\x97")]
    expected = decode(tokenizer, ids)
    assert expected == "\U0001fcac" + REPLACEMENT_CHAR * 2
    for sizes in ([1], [5, 1], [6]):
        assert "".join(streamed(tokenizer, ids, sizes)) == expected, sizes


def test_qwen_a_character_ending_in_a_token_that_starts_the_next_streams_whole():
    """Qwen's vocabulary has tokens such as a0 ed (a character's last byte,
    the next one's first): "😠" (f0 9f 98 a0) then "ퟤ" (ed 9f a4) as
    [f0][9f][98][a0 ed][9f][a4] ends no token on a character's end before
    the last."""
    tokenizer = needs_qwen()
    ids = [byte_token(tokenizer, b) for b in (b"\xf0", b"\x9f", b"\x98", b"\xa0\xed", b"\x9f", b"\xa4")]
    assert decode(tokenizer, ids) == "😠\ud7e4"
    for sizes in ([1], [5, 1], [2]):
        out = streamed(tokenizer, ids, sizes)
        assert "".join(out) == "😠\ud7e4", sizes
        assert not any(REPLACEMENT_CHAR in text for text in out), sizes


class Counting:
    """A tokenizer that records the length of every window it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.windows = tokenizer, []

    def decode(self, ids, **kwargs):
        self.windows.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_a_long_valid_text_of_no_token_ending_on_a_character_streams_with_bounded_work():
    """The tiny BPE's "日" chain, 400 tokens long: held until a token ends
    on a character's end, it would be decoded whole at every add (quadratic);
    cut a few tokens from the end, it lost characters. It streams as it
    comes, each add decoding a few short windows."""
    tokenizer = byte_level_bpe()
    e6_97, a5_e6, x97, xa5 = (byte_token(tokenizer, b) for b in (b"\xe6\x97", b"\xa5\xe6", b"\x97", b"\xa5"))
    ids = [e6_97] + [a5_e6, x97] * 200 + [xa5]
    counting = Counting(tokenizer)
    detok = IncrementalDetokenizer(counting)
    out = [detok.add([token]) for token in ids] + [detok.flush()]
    assert "".join(out) == "日" * 201 and REPLACEMENT_CHAR not in "".join(out)
    assert sum(map(bool, out)) > 50, "it streams"
    assert max(counting.windows) <= 12 and len(counting.windows) <= 6 * len(ids)


def test_qwen_a_long_run_of_tokens_that_each_end_inside_a_character_streams_whole():
    """Qwen's token 92 e1 9e ends a Khmer letter (e1 9e 92) and starts the
    next: [e1][9e] then that token 2,000 times spells 2,001 letters and no
    token but the last ends on a character's end. It lost every other
    letter to U+FFFD."""
    tokenizer = needs_qwen()
    straddling = byte_token(tokenizer, b"\x92\xe1\x9e")
    ids = [byte_token(tokenizer, b"\xe1"), byte_token(tokenizer, b"\x9e")] + [straddling] * 2000
    ids.append(byte_token(tokenizer, b"\x92"))
    counting = Counting(tokenizer)
    detok = IncrementalDetokenizer(counting)
    out = [detok.add([token]) for token in ids] + [detok.flush()]
    assert "".join(out) == decode(tokenizer, ids) == "\u1792" * 2001
    assert max(counting.windows) <= 12


# Tokens that split characters: every byte alone, and the multi-byte tokens
# that end or start inside a character (the tiny BPE learned some across
# characters: "日本語" gives a5 e6).
@functools.cache
def partial_tokens(tokenizer) -> list[int]:
    table = {c: b for b, c in _byte_chars().items()}
    vocab = vocab_of(tokenizer)
    out = []
    for token, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if all(c in table for c in token):
            data = bytes(table[c] for c in token)
            try:
                data.decode()
            except UnicodeDecodeError:
                out.append(i)
            else:
                if len(data) == 1 or len(out) % 7 == 0:
                    out.append(i)
    return out


@st.composite
def byte_level_ids(draw, tokenizer):
    pool = partial_tokens(tokenizer)
    special = [t for t in (getattr(tokenizer, "eos_token_id", None),) if t is not None]
    whole = st.integers(0, len(tokenizer) - 1)
    one = st.one_of(st.sampled_from(pool), st.sampled_from(pool), whole, *(st.sampled_from(special),) * bool(special))
    return draw(st.lists(one, max_size=30))


sizes_strategy = st.lists(st.integers(1, 7), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(byte_level_ids(byte_level_bpe()), sizes_strategy)
@example([byte_token(byte_level_bpe(), b) for b in (b"\xf0\x9f", b"\xb2", b"\xac\xe8", b"\xb0", b"\xf0\x9f")], [1])
def test_byte_level_any_tokens_any_rounds_stream_the_full_decode(ids, sizes):
    tokenizer = byte_level_bpe()
    assert "".join(streamed(tokenizer, ids, sizes)) == decode(tokenizer, ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), sizes_strategy, st.lists(st.integers(0, 151642), min_size=1, max_size=6))
def test_qwen_any_tokens_any_rounds_stream_the_full_decode(data, sizes, prompt):
    tokenizer = needs_qwen()
    ids = data.draw(byte_level_ids(tokenizer))
    if decode(tokenizer, prompt).endswith(REPLACEMENT_CHAR):
        prompt = prompt + tokenizer.encode(" x", add_special_tokens=False)  # prompts are whole text
    assert "".join(streamed(tokenizer, ids, sizes, prompt)) == reference(tokenizer, prompt, ids, [])[0]


# -------------------------------------------- the detokenizer and the stops together


@st.composite
def served_case(draw, tokenizer, ids_strategy):
    ids = draw(ids_strategy)
    prompt = draw(st.one_of(st.none(), st.just(tokenizer.encode("say:", add_special_tokens=False))))
    text = reference(tokenizer, prompt, ids, [])[0]
    # Stops from the text itself (so that they hit, at a split character,
    # across rounds, overlapping) and a few that may not.
    from_text = st.builds(lambda a, n: text[a:a + n], st.integers(0, max(len(text) - 1, 0)), st.integers(1, 4))
    stops = draw(st.lists(st.one_of(from_text, st.text("ab ☃日\ufffd", min_size=1, max_size=3)), max_size=4))
    stops = [s for s in stops if s]
    return prompt, ids, draw(sizes_strategy), stops


def check_served(tokenizer, prompt, ids, sizes, stops):
    texts, stopped = served(tokenizer, prompt, rounds_of(ids, sizes), stops)
    assert ("".join(texts), stopped) == reference(tokenizer, prompt, ids, stops)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(served_case(byte_level_bpe(), byte_level_ids(byte_level_bpe())))
def test_byte_level_served_text_is_the_decode_cut_at_the_earliest_stop(case):
    check_served(byte_level_bpe(), *case)


text_alphabet = st.sampled_from(list("abehlorwt ,.!éö☃日本語🎉😀ß∑\n"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(METASPACE)), st.data())
def test_sentencepiece_served_text_is_the_decode_cut_at_the_earliest_stop(name, data):
    # SentencePiece's byte fallback decodes a run of byte tokens that is no
    # UTF-8 as U+FFFD for every byte, even the ones already streamed as
    # text; so only token sequences that spell text are compared.
    tokenizer = METASPACE[name]
    ids_strategy = st.text(text_alphabet, max_size=30).map(lambda t: tokenizer.encode(t, add_special_tokens=False))
    check_served(tokenizer, *data.draw(served_case(tokenizer, ids_strategy)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_qwen_served_text_is_the_decode_cut_at_the_earliest_stop(data):
    tokenizer = needs_qwen()
    text_ids = st.text(text_alphabet, max_size=40).map(lambda t: tokenizer.encode(t, add_special_tokens=False))
    check_served(tokenizer, *data.draw(served_case(tokenizer, st.one_of(text_ids, byte_level_ids(tokenizer)))))
