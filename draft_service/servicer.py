"""DraftService over a drafter: translates protobuf to the core and back."""
from __future__ import annotations

import time

from specdec import grpc_errors
from specdec.model_service import SessionServicer
from specdec.telemetry import A_APPENDED, A_K, A_TOKENS, NOOP, SPAN_PROPOSE
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(SessionServicer, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker, limits, backend_kind: str = "model", drafter=None, telemetry=NOOP):
        super().__init__(worker, limits, backend=drafter, telemetry=telemetry)
        self.backend_kind = backend_kind

    @grpc_errors.stream
    async def Propose(self, request, context):
        attributes = {A_K: request.num_tokens, A_APPENDED: len(request.append_token_ids)}
        with self.telemetry.server_span(SPAN_PROPOSE, context.invocation_metadata(), attributes) as span:
            drafts = await self.worker.run(
                self.backend.propose, request.session_id,
                request.keep_length if request.HasField("keep_length") else None,
                list(request.append_token_ids), request.num_tokens,
            )
            sent = 0
            while True:
                # Each step (one forward pass) runs on the engine thread; the token
                # is on the wire as soon as it is drafted.
                start = time.perf_counter()
                draft = await self.worker.run(next, drafts, None)
                if draft is None:
                    break
                sent += 1
                yield _to_wire(draft, time.perf_counter() - start)
            span.set_attribute(A_TOKENS, sent)


def _to_wire(draft, seconds: float) -> draft_pb2.ProposeResponse:
    msg = draft_pb2.ProposeResponse(index=draft.index, token_id=draft.token_id, length=draft.length,
                                    compute_micros=round(seconds * 1e6))
    if draft.q is not None:
        ids, probs = draft.q.to_lists()
        msg.q.CopyFrom(common_pb2.SparseDistribution(token_ids=ids, probs=probs))
    return msg
