"""The round call each model service answers on its lane (specdec/rpc/lane.py)
and on its call stream (specdec/rpc/call_stream.py): the method and its call
and reply messages, in one place for the services, the orchestrator's
clients and the fuzzer."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.v1 import draft_pb2, target_pb2


@dataclass(frozen=True)
class LaneMethod:
    path: str  # the unary method's full name, which a lane's hello names
    call_type: type  # the message carrying one call (its id, request, trace context)
    reply_type: type  # the message answering it (its id, response or error)


DRAFT = LaneMethod("/specdec.v1.DraftService/ProposeAll", draft_pb2.ProposeAllCall, draft_pb2.ProposeAllReply)
TARGET = LaneMethod("/specdec.v1.TargetService/Verify", target_pb2.VerifyCall, target_pb2.VerifyReply)
