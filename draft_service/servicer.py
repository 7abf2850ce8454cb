"""DraftService over a drafter: translates protobuf to the core and back."""
from __future__ import annotations

from specdec import grpc_errors
from specdec.model_service import SessionServicer
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(SessionServicer, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker, limits, backend_kind: str = "model", drafter=None):
        super().__init__(worker, limits, backend=drafter)
        self.backend_kind = backend_kind

    @grpc_errors.stream
    async def Propose(self, request, context):
        drafts = await self.worker.run(
            self.backend.propose, request.session_id,
            request.keep_length if request.HasField("keep_length") else None,
            list(request.append_token_ids), request.num_tokens,
        )
        while True:
            # Each step (one forward pass) runs on the engine thread; the token
            # is on the wire as soon as it is drafted.
            draft = await self.worker.run(next, drafts, None)
            if draft is None:
                return
            yield _to_wire(draft)


def _to_wire(draft) -> draft_pb2.ProposeResponse:
    msg = draft_pb2.ProposeResponse(index=draft.index, token_id=draft.token_id, length=draft.length)
    if draft.q is not None:
        ids, probs = draft.q.to_lists()
        msg.q.CopyFrom(common_pb2.SparseDistribution(token_ids=ids, probs=probs))
    return msg
