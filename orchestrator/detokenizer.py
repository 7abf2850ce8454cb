"""Incremental detokenization: stream text as tokens arrive, never half a character.

Decoding tokens one at a time and concatenating is wrong for real tokenizers:
byte-level BPE splits a multi-byte UTF-8 character across tokens (each piece alone
decodes to U+FFFD), and SentencePiece drops the leading space of the first token in
a decode, so " world" alone decodes to "world". The standard fix (vLLM, TGI) keeps
two offsets into the token list:

- prefix_offset: start of a short window of already-emitted tokens, kept as context;
- read_offset: end of what has been emitted.

Each step decodes ids[prefix_offset:read_offset] (text already emitted from that
window) and ids[prefix_offset:] (the same window plus the new tokens); the new text
is the second minus the first. If the second ends with U+FFFD, the last character is
incomplete, and nothing moves until more tokens complete it.

Example (byte-level BPE, "日" = e6 97 a5 split over two tokens):
  add([hi])       -> "hi"
  add([e6 97])    -> ""     decodes to "hi\ufffd": held back
  add([a5])       -> "日"   window "hi" + "日", minus "hi"
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first generated tokens (vLLM's value).
PROMPT_CONTEXT_TOKENS = 5
# The most tokens one character is split over: UTF-8 has at most 4 bytes, and
# a byte-level or byte-fallback token carries at least one.
MAX_CHAR_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text.

    The concatenation of every ``add`` result and ``flush`` equals
    ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` (with
    ``clean_up_tokenization_spaces`` off) when no prompt is given. With a prompt,
    its last few tokens are context, so the first generated token keeps its leading
    space, as it does when the prompt and the output are decoded together.

    Limitations:
    - Decoding always runs with ``clean_up_tokenization_spaces=False``: that
      clean-up rewrites text across token boundaries (" ." -> "."), so the decode of
      a window is not a prefix of the decode of a longer window.
    - Text that legitimately ends in U+FFFD (a model emitting invalid UTF-8) is held
      back until a later token, ``flush``, or more than MAX_CHAR_TOKENS tokens
      are held (then the held text up to its unfinished last character is
      emitted, bytes that are no UTF-8 as U+FFFD, if one of the last few
      tokens ends there).
    - SentencePiece's byte fallback decodes a run of byte tokens that is no
      UTF-8 as one U+FFFD per byte, even the bytes before the run went wrong:
      text streamed before a later byte broke the run (valid then) differs
      from the full decode. Only output that is no UTF-8 is affected.
    - If the prompt itself ends inside a multi-byte character, the first generated
      text may be garbled; prompts are whole text in practice.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids or [])
        self._read_offset = len(self._ids)
        self._prefix_offset = self._context_start(self._read_offset)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far by add() and flush()."""
        return "".join(self._text_parts)

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the text they complete (may be "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if not new_text.endswith(REPLACEMENT_CHAR):
            return self._emit(prefix_text, new_text, len(self._ids))
        # The last character is incomplete; emit up to the latest token that ends on
        # a whole character, so one partial character does not hold back a chunk.
        # Only the last few ends can be that: a character spans at most
        # MAX_CHAR_TOKENS tokens.
        last, full_text, ends = len(self._ids), new_text, []
        for end in range(last - 1, max(self._read_offset, last - MAX_CHAR_TOKENS), -1):
            new_text = self._decode(self._ids[self._prefix_offset:end])
            if not new_text.endswith(REPLACEMENT_CHAR):
                return self._emit(prefix_text, new_text, end)
            ends.append((end, new_text))
        if last - self._read_offset > MAX_CHAR_TOKENS:
            # More tokens held than a character spans, and still no whole one:
            # the model emitted bytes that are no UTF-8 (each U+FFFD for good).
            # Emit them as such, holding back only what may yet be a character's
            # start. Held for good instead, they were decoded again on every
            # add, and on every end: cubic in their number (800 of them took 3 s).
            # What is final is the held text but its unfinished last
            # character. A cut at a fixed distance from the end could fall
            # inside a character (a token may end one character and start
            # the next, as 92 e1 9e does in Qwen's vocabulary), streaming it
            # as U+FFFD for good: valid text held longer than a character's
            # tokens lost characters. So the cut is at an end whose window
            # text is final, or ends in a character split there that the
            # tokens after complete: that U+FFFD (one, for the split
            # character's bytes) then stands for the character, emitted
            # whole, in this window's text and the next ones' prefix text.
            # Holding such runs instead decoded them whole on every add.
            final_text = full_text[:-1]
            for end, text in ends:
                if final_text.startswith(text):
                    return self._emit(prefix_text, text, end)
                if len(text) <= len(final_text) and final_text.startswith(text[:-1]):
                    return self._emit(prefix_text, final_text[:len(text)], end)
        return ""

    def flush(self) -> str:
        """Return whatever is held back (even an incomplete character, as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        return self._emit(prefix_text, new_text, len(self._ids), final=True)

    def _emit(self, prefix_text: str, new_text: str, end: int, final: bool = False) -> str:
        # Tokens that decode to nothing (skipped special tokens) wait in the window.
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._text_parts.append(delta)
        return delta

    def _context_start(self, read_offset: int) -> int:
        """Start of the prompt context window, moved back off a split character."""
        start = max(read_offset - PROMPT_CONTEXT_TOKENS, 0)
        # A UTF-8 character has at most 4 bytes, so at most 3 steps back.
        for _ in range(3):
            if start == 0 or not self._decode(self._ids[start:read_offset]).startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        return start

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)
