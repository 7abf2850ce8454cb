"""specdec: distributed speculative decoding over gRPC.

Shared package of the three roles: the model engine (`specdec.engine`), the
sampling math (`specdec.sampling`), the model cache (`specdec.models`), the
gRPC plumbing (`specdec.rpc`), configuration, telemetry and the `specd` CLI
(`specdec.cli`).
"""

__version__ = "0.1.0"

# Before anything builds a grpc channel or server: grpc's I/O engine (specdec/rpc/grpc_io.py).
from specdec.rpc import grpc_io as _grpc_io  # noqa: E402

_grpc_io.choose()
