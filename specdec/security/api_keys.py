"""API keys of the orchestrator's front doors (pure: no grpc, no HTTP).

Keys come from a file (`--api-key-file`, one key per line, `#` comments and
blank lines ignored; a mounted Kubernetes Secret fits) and/or the environment
variable SPECD_API_KEYS (comma-separated). Several keys may be valid at once,
so a key can be rotated without downtime. A caller sends one as
`authorization: Bearer KEY` (gRPC metadata or HTTP header), the way `openai`
clients already do. Keys are compared in constant time.
"""
from __future__ import annotations

import hmac
import os

KEYS_ENV = "SPECD_API_KEYS"
BEARER = "bearer "


class ApiKeyError(ValueError):
    """The key file cannot be read or holds no key."""


def load_api_keys(path: str = "", environ: dict | None = None) -> tuple[bytes, ...]:
    """Every valid key; empty when neither the file nor the environment names
    one (then no key is required)."""
    environ = os.environ if environ is None else environ
    keys = [k.strip() for k in environ.get(KEYS_ENV, "").split(",") if k.strip()]
    _check_printable(keys, KEYS_ENV)
    if path:
        try:
            # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first key
            with open(path, encoding="utf-8-sig") as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            raise ApiKeyError(f"cannot read the API key file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ApiKeyError(f"the API key file {path} is not UTF-8 text") from None
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ApiKeyError(f"the API key file {path} holds no key (one per line)")
        _check_printable(from_file, f"the API key file {path}")
        keys.extend(from_file)
    return tuple(dict.fromkeys(k.encode() for k in keys))


def _check_printable(keys: list[str], source: str) -> None:
    """A key must be printable ASCII without spaces: what an HTTP header and
    gRPC metadata carry alike. Any other would be refused at one door or both,
    with nothing to say why."""
    for number, key in enumerate(keys, 1):
        if not all("!" <= c <= "~" for c in key):
            raise ApiKeyError(f"key {number} of {source} holds a character other than printable ASCII "
                              "(or a space): no client could send it")


class ApiKeyChecker:
    """Checks an `authorization` value against the valid keys."""

    def __init__(self, keys: tuple[bytes, ...]):
        self.keys = keys

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def problem(self, authorization: str | None) -> str | None:
        """None when the value carries a valid key (or none is required),
        else what is wrong with it, for the caller (never echoing the key)."""
        if not self.keys:
            return None
        if not authorization:
            return "an API key is required: send it as 'authorization: Bearer KEY'"
        if not authorization[:len(BEARER)].lower() == BEARER:
            return "the authorization header must be 'Bearer KEY'"
        given = authorization[len(BEARER):].strip().encode()
        # Every key is compared (no early exit), each in constant time.
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given, key)
        return None if matched else "the API key is not valid"
