"""TargetService over the verifier: translates protobuf to the core and back."""
from __future__ import annotations

import time

from specdec import grpc_errors
from specdec.model_service import SessionServicer
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.verifier import VerifyRequestItem


class TargetServicer(SessionServicer, target_pb2_grpc.TargetServiceServicer):
    @grpc_errors.unary
    async def Verify(self, request, context):
        items = [
            VerifyRequestItem(
                session_id=it.session_id,
                keep_length=it.keep_length if it.HasField("keep_length") else None,
                append=list(it.append_token_ids),
                drafts=list(it.draft_token_ids),
                draft_q=[(list(q.token_ids), list(q.probs)) for q in it.draft_q],
            )
            for it in request.items
        ]
        start = time.perf_counter()
        batch = await self.worker.run(self.backend.verify, items)
        micros = int((time.perf_counter() - start) * 1e6)
        results = [_result_to_wire(it.session_id, r) for it, r in zip(items, batch.items)]
        return target_pb2.VerifyResponse(results=results, batch_size=batch.batch_size, compute_micros=micros)

    @grpc_errors.unary
    async def Decode(self, request, context):
        start = time.perf_counter()
        tokens, length = await self.worker.run(
            self.backend.decode, request.session_id, _keep(request),
            list(request.append_token_ids), request.num_tokens, list(request.stop_token_ids),
        )
        micros = int((time.perf_counter() - start) * 1e6)
        return target_pb2.DecodeResponse(token_ids=tokens, length=length, compute_micros=micros)


def _result_to_wire(session_id: str, result) -> target_pb2.VerifyResult:
    msg = target_pb2.VerifyResult(session_id=session_id, length=result.length)
    if result.error is not None:
        msg.error.code = grpc_errors.code_number(result.error)
        msg.error.message = str(result.error)
        return msg
    outcome = result.outcome
    if outcome.argmax_ids:
        msg.argmax_token_ids.extend(outcome.argmax_ids)
    else:
        msg.target_probs.extend(outcome.target_probs)
        msg.recovery_token_ids.extend(outcome.recovery_ids)
        msg.bonus_token_id = outcome.bonus_id
    return msg


def _keep(request) -> int | None:
    return request.keep_length if request.HasField("keep_length") else None
