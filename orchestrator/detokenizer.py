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
      are held (then all but the last few are emitted, as U+FFFD).
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
        last = len(self._ids)
        for end in range(last - 1, max(self._read_offset, last - MAX_CHAR_TOKENS), -1):
            new_text = self._decode(self._ids[self._prefix_offset:end])
            if not new_text.endswith(REPLACEMENT_CHAR):
                return self._emit(prefix_text, new_text, end)
        if last - self._read_offset > MAX_CHAR_TOKENS:
            # More tokens held than a character spans, and still no whole one:
            # the model emitted bytes that are no UTF-8 (each U+FFFD for good).
            # Emit them as such, holding back only what may yet be a character's
            # start. Held for good instead, they were decoded again on every
            # add, and on every end: cubic in their number (800 of them took 3 s).
            end = last - (MAX_CHAR_TOKENS - 1)
            return self._emit(prefix_text, self._decode(self._ids[self._prefix_offset:end]), end, final=True)
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
