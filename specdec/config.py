"""One configuration object per role, filled from flags and environment.

Each dataclass field becomes a flag `--field-name` whose default comes from the
environment variable `SPECD_FIELD_NAME`, else the field's default: a flag wins
over the environment, which wins over the default. Help text lives in the
field's metadata, next to the field.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, TypeVar

T = TypeVar("T")

MAX_PORT = 65535


def check_port(port: int, what: str, lowest: int = 0, meaning: str = "0 (any free port)") -> None:
    """Raise ValueError unless lowest <= port <= MAX_PORT; `meaning` says
    what the values below 1 stand for. Checked before anything binds: grpc
    binds 99999 modulo 65536 and a negative port wrapped round, and sockets
    raise OverflowError."""
    if not lowest <= port <= MAX_PORT:
        raise ValueError(f"{what} must be {meaning} or a port number up to {MAX_PORT}, got {port}")


def opt(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - argparse's word
    """A dataclass field with its flag's help text."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def env_name(field_name: str) -> str:
    return "SPECD_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(kind: type, text: str) -> Any:
    return _parse_bool(text) if kind is bool else kind(text)


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                  defaults: dict[str, Any] | None = None) -> None:
    """Add one flag per field of `cls`, with env-var defaults; `defaults`
    overrides the field defaults (the environment still wins)."""
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kind = type(f.default)
        flag = "--" + f.name.replace("_", "-")
        env = env_name(f.name)
        default = (defaults or {}).get(f.name, f.default)
        if env in os.environ:
            try:
                default = _convert(kind, os.environ[env])
            except ValueError as exc:
                parser.error(f"environment variable {env}: {exc}")
        help_text = f"{f.metadata['help']} [env {env}; default: {default!r}]"
        if kind is bool:
            group.add_argument(flag, dest=f.name, default=default, action=argparse.BooleanOptionalAction,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, default=default, type=kind, help=help_text,
                               choices=f.metadata.get("choices"))


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build `cls` from parsed args (fields absent from args keep defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
