"""The model-loading flags that several commands share: --device, --dtype,
--threads, and --draft-device/--target-device for commands that run both roles.

Each flag is written once here. Its base help and choices come from the
EngineConfig field it ends up in (what `specd serve` shows); a command gives
its own default and, where it matters, what the flag applies to there.
"""
from __future__ import annotations

import dataclasses

from specdec.engine.config import EngineConfig

_FIELDS = {f.name: f.metadata for f in dataclasses.fields(EngineConfig)}
DTYPES: tuple[str, ...] = _FIELDS["dtype"]["choices"]


def _help(field: str, applies_to: str, default_text: str) -> str:
    where = f"; {applies_to}" if applies_to else ""
    return f"{_FIELDS[field]['help']}{where} (default {default_text})"


def add_device(parser, default: str = "cpu", applies_to: str = "") -> None:
    """--device DEVICE: cpu, cuda or cuda:N."""
    parser.add_argument("--device", default=default, help=_help("device", applies_to, default))


def add_role_devices(parser) -> None:
    """--draft-device / --target-device: one role's device, when not --device."""
    for role in ("draft", "target"):
        parser.add_argument(f"--{role}-device", default=None, help=f"the {role}'s device (default --device)")


def add_dtype(parser, default: str | None = "auto", applies_to: str = "", default_text: str = "") -> None:
    """--dtype {auto,bfloat16,float16,float32}. A default of None leaves the
    choice to the command (explain it in `default_text`)."""
    parser.add_argument("--dtype", default=default, choices=DTYPES,
                        help=_help("dtype", applies_to, default_text or str(default)))


def add_threads(parser, default: int | None = 0, applies_to: str = "", default_text: str = "") -> None:
    """--threads N: intra-op threads of CPU forward passes (0: torch's
    default). A default of None leaves the choice to the command (explain it
    in `default_text`)."""
    parser.add_argument("--threads", type=int, default=default,
                        help=_help("threads", applies_to, default_text or str(default)))
