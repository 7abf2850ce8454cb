"""Stop sequences on streamed text.

Semantics (OpenAI's): the output is the generated text truncated at the earliest
START position of any occurrence of any stop string; the stop string and everything
after it are never emitted. With stops ["bc", "abcd"] the text "xabcd" gives "x"
(the "abcd" at 1 starts before the "bc" at 2), and "xabcx" gives "xa".

Streaming: a text position is
- safe when no stop string matches there and none can still match there (the text
  from that position on already differs from every stop string);
- a match when a stop string matches there completely;
- pending when the text from that position on is a proper prefix of a stop string.
Text is emitted up to the first position that is not safe. If that position is a
match, generation stops there; if it is pending, the text from it on is held back
until later text decides. A complete match after a pending position does not stop
generation yet: the pending one starts earlier and may still complete.
"""
from __future__ import annotations

from enum import Enum


def validate_stops(stops: list[str], max_count: int = 8, max_len: int = 256) -> list[str]:
    """Check a request's stop strings; return them. Raises ValueError with a message."""
    if len(stops) > max_count:
        raise ValueError(f"at most {max_count} stop sequences are allowed, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise ValueError(f"stop sequence {i} must be a string, got {type(stop).__name__}")
        if not stop:
            raise ValueError(f"stop sequence {i} is empty")
        if len(stop) > max_len:
            raise ValueError(f"stop sequence {i} is {len(stop)} characters long; the limit is {max_len}")
    return list(stops)


class _Position(Enum):
    SAFE = 0
    MATCH = 1
    PENDING = 2


class StopMatcher:
    """Finds stop strings in text that arrives in pieces; see the module docstring.

    Per feed, the work is O(held-back + new text) * sum of stop lengths.
    """

    def __init__(self, stops: list[str]):
        if any(not stop for stop in stops):
            raise ValueError("stop sequences must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._first_chars = frozenset(stop[0] for stop in self._stops)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched (by feed or by flush)."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to emit now, stopped).

        After a stop, every feed returns ("", True).
        """
        if self._stopped:
            return "", True
        self._held += text
        end, kind = self._scan(final=False)
        emit, self._held = self._held[:end], self._held[end:]
        if kind is _Position.MATCH:
            self._stop()
        return emit, self._stopped

    def flush(self) -> str:
        """End of generation: return the held-back text, cut at a stop string if one
        matches in it (``stopped`` then becomes True)."""
        if self._stopped:
            return ""
        end, kind = self._scan(final=True)
        emit = self._held[:end]
        if kind is _Position.MATCH:
            self._stop()
        self._held = ""
        return emit

    def _stop(self) -> None:
        self._stopped = True
        self._held = ""

    def _scan(self, final: bool) -> tuple[int, _Position]:
        """First position in the held text that is not safe, and what it is.

        With final=True no more text will come, so pending positions are safe.
        Returns (len(held), SAFE) when every position is safe.
        """
        for i, char in enumerate(self._held):
            if char not in self._first_chars:
                continue
            kind = self._classify(i)
            if kind is _Position.MATCH or (kind is _Position.PENDING and not final):
                return i, kind
        return len(self._held), _Position.SAFE

    def _classify(self, i: int) -> _Position:
        held, remaining = self._held, len(self._held) - i
        kind = _Position.SAFE
        for stop in self._stops:
            if held.startswith(stop, i):
                return _Position.MATCH
            if remaining < len(stop) and stop.startswith(held[i:]):
                kind = _Position.PENDING
        return kind
