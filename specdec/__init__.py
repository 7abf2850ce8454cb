"""specdec: distributed speculative decoding over gRPC.

Shared package of the three roles: the model engine (`specdec.engine`), the
sampling math (`specdec.sampling`), the model cache (`specdec.models`), the
gRPC plumbing (`specdec.rpc`), configuration, telemetry and the `specd` CLI
(`specdec.cli`).
"""

__version__ = "0.1.0"
