"""The target service's settings that `specd serve target`'s flags need,
apart from the service (which imports torch)."""
from __future__ import annotations

DEFAULT_PORT = 50053
