"""argparse `type=` helpers that the commands share: a value no run could
use is refused by argparse itself (`specd CMD: error: argument --port: ...`,
exit 2) before anything starts, rather than as a traceback, a port the
kernel wraps modulo 65536, or a wait that never ends.

The wire ranges (INT32_MAX, UINT64_MAX) are those of the Generate request's
fields, which protobuf refuses with an unhelpful "Value out of range".
"""
from __future__ import annotations

import argparse
import math
from typing import Callable

from specdec.config import MAX_PORT

INT32_MAX = 2**31 - 1  # the request's int32 fields: max_tokens, top_k, num_draft_tokens, token ids
UINT64_MAX = 2**64 - 1  # its seed


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_in(lowest: int, highest: int, meaning: str = "", excluded: tuple[int, ...] = ()) -> Callable[[str], int]:
    """An integer in [lowest, highest], none of `excluded`; `meaning` (e.g.
    "0: the server's default") is added to the message."""
    note = f" ({meaning})" if meaning else ""

    def parse(text: str) -> int:
        value = _int(text)
        if not lowest <= value <= highest or value in excluded:
            raise argparse.ArgumentTypeError(f"must be in [{lowest}, {highest}]{note}, got {value}")
        return value

    parse.__name__ = f"integer in [{lowest}, {highest}]"  # argparse's name for it in other messages
    return parse


def at_least(lowest: int) -> Callable[[str], int]:
    """An integer >= lowest (a count: repetitions, tokens)."""
    def parse(text: str) -> int:
        value = _int(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be at least {lowest}, got {value}")
        return value

    parse.__name__ = f"integer >= {lowest}"
    return parse


# A TCP port to listen on (0: any free one).
port = int_in(0, MAX_PORT, "0: any free port")


def non_negative(text: str) -> float:
    """A finite number >= 0: a duration (NaN would make a deadline never
    pass, or pass at once), a delay, a rate."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


duration = non_negative


def utf8_text(text: str) -> str:
    """Text as the request carries it: valid UTF-8. An argument with bytes
    that are not (e.g. $'caf\\xe9' from bash, Latin-1) reaches Python as
    lone surrogates, which protobuf cannot encode."""
    try:
        check_utf8(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def check_utf8(text: str, what: str = "the text") -> None:
    """Raise ValueError unless `text` encodes as UTF-8; `what` names it in
    the message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        shown = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise ValueError(f"{what} is not valid UTF-8 ({shown} at character {exc.start}): pass UTF-8 text") from None
