"""Target replicas must be one model (docs/reliability.md "Several replicas"):
a request moves between them when one fails, and every token must come from
the target model's own distribution. The weights' fingerprint
(specdec/models/fingerprint.py, ModelInfo.weights_fingerprint) tells two
checkpoints of one architecture apart; the orchestrator refuses a target
replica whose fingerprint, dtype, weight form or EOS ids differ, at start-up
and when it joins later (orchestrator/replica_checks.py `check_same_model`, through
`check_replica_ids`). Drafts need not be the target's model."""
from __future__ import annotations

import copy
import logging
import socket
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from orchestrator import replica_checks as C, replicas as R, server as S
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import LoopSettings
from specdec.engine.config import EngineConfig
from specdec.engine.engine import ModelEngine
from specdec.engine.loading import load_model
from specdec.errors import FailedPrecondition
from specdec.models.fingerprint import weights_fingerprint
from specdec.rpc import grpc_errors
from specdec.security.tls import TlsConfig
from specdec.v1 import common_pb2
from tests.conftest import tiny_model
from tests.harness import (BackgroundLoop, local_config, running_target, start_orchestrator_on_replicas,
                           target_replicas_behind_one_name, wait_until)

# ------------------------------------------------------------------ the fingerprint


def fine_tuned(model, scale: float = 1e-3, only: str | None = None):
    """`model` with its weights (those whose name contains `only`, else all)
    moved a little, as a fine-tune moves them: same architecture, other model."""
    tuned = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if only is None or only in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return tuned


def test_the_fingerprint_tells_two_checkpoints_of_one_config_apart(arch):
    base = weights_fingerprint(tiny_model(arch, seed=0))
    assert base.startswith("w1:")
    assert weights_fingerprint(tiny_model(arch, seed=0)) == base, "the same weights: the same model"
    assert weights_fingerprint(tiny_model(arch, seed=1)) != base, "other random weights"
    assert weights_fingerprint(fine_tuned(tiny_model(arch, seed=0))) != base, "a fine-tune of every weight"


def test_a_fine_tune_of_one_layer_or_a_norm_is_another_model():
    model = tiny_model("llama", seed=0)
    base = weights_fingerprint(model)
    assert weights_fingerprint(fine_tuned(model, only="layers.1.mlp.down_proj")) != base
    assert weights_fingerprint(fine_tuned(model, only="model.norm")) != base  # a small tensor, read whole
    assert weights_fingerprint(model.to(torch.bfloat16)) != base, "the same weights at another dtype compute otherwise"


def test_the_config_numerics_count():
    model = tiny_model("llama", seed=0)
    base = weights_fingerprint(model)
    model.config.rms_norm_eps *= 10
    assert weights_fingerprint(model) != base


def test_the_fingerprint_is_stable_across_loads_and_the_engines_changes_of_form(tmp_path):
    model = tiny_model("qwen2", seed=0)
    base = weights_fingerprint(model)
    model.save_pretrained(tmp_path / "m")
    cfg = EngineConfig(model=str(tmp_path / "m"), dtype="float32", device="cpu")
    first, second = (weights_fingerprint(load_model(cfg).model) for _ in range(2))
    assert first == second == base, "saved and loaded twice: still the model it was"
    # The engine fuses q/k/v and gate/up (fused_linears.py) in place: the model
    # keeps its fingerprint, and so does an engine over it or over a copy of it.
    engine = ModelEngine(model, EngineConfig(dtype="float32", fused_layers="on"), name="m")
    assert engine.fused is not None and engine.info.weights_fingerprint == base
    assert weights_fingerprint(model) == base
    again = ModelEngine(copy.deepcopy(model), EngineConfig(dtype="float32"), name="m")
    assert again.info.weights_fingerprint == base


def test_a_synthetic_model_is_fingerprinted_by_what_determines_its_weights():
    cfg = EngineConfig(model="synth:tiny", dtype="float32", device="cpu")
    first, second = (weights_fingerprint(load_model(cfg).model) for _ in range(2))
    assert first == second, "one name, one seed: one model"


def test_the_service_reports_it_in_model_info():
    engine = ModelEngine(tiny_model("llama", seed=0), EngineConfig(dtype="float32"), name="m")
    with running_target(engine) as (_, stub, _):
        info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30).info
    assert info.weights_fingerprint == engine.info.weights_fingerprint == weights_fingerprint(engine.model)


# ------------------------------------------------------------------ the check

A, B = "10.0.0.1:1", "10.0.0.2:1"
FP = "w1:" + "a" * 64


def info(**fields):
    base = dict(model_name="m", vocab_size=128, usable_vocab_size=128, tokenizer_fingerprint="untokenized-vocab-128",
                dtype="bfloat16", weights="", eos_token_ids=[2, 7], weights_fingerprint=FP, backend="model",
                max_context=1024, max_draft_tokens=8)
    return common_pb2.ModelInfo(**{**base, **fields})


def replica(address, model_info):
    return R.Replica(address, client=SimpleNamespace(info=model_info))


def pool(*replicas):
    async def never(_):
        raise AssertionError("not used")

    p = R.ReplicaPool("target.svc:1", never, never)
    p.replicas = {r.address: r for r in replicas}
    return p


def at_start_up(reference, other):
    C.check_replicas(pool(replica(A, reference), replica(B, other)), None)


def at_admission(reference, other):
    settings = LoopSettings(max_context=1024, max_draft_tokens=8)
    C.admission(reference, settings, draft=False, reference_address=A)(replica(B, other))


WHEN = {"start-up": at_start_up, "admission": at_admission}
DIFFERENCES = {
    "weights fingerprint": dict(weights_fingerprint="w1:" + "b" * 64),
    "dtype": dict(dtype="float16"),
    "weights": dict(weights="int8"),
    "EOS token ids": dict(eos_token_ids=[2]),
}


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("what", DIFFERENCES)
def test_a_target_replica_of_another_model_is_refused(when, what):
    with pytest.raises(FailedPrecondition) as refused:
        WHEN[when](info(), info(**DIFFERENCES[what]))
    message = str(refused.value)
    assert grpc_errors.status_for(refused.value)[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{what} " in message and "not the same model" in message, message
    assert A in message and B in message, f"both replicas named: {message}"


@pytest.mark.parametrize("when", WHEN)
def test_the_same_model_is_admitted_whatever_the_order_of_its_eos_ids(when):
    WHEN[when](info(), info(eos_token_ids=[7, 2, 7]))


@pytest.mark.parametrize("when", WHEN)
def test_without_a_fingerprint_the_model_names_are_compared_with_a_warning(when, caplog):
    old = info(weights_fingerprint="")  # a service older than the field
    with caplog.at_level(logging.WARNING, logger="orchestrator.replica_checks"):
        WHEN[when](info(), old)
    assert any("no weights fingerprint" in r.getMessage() and "only their model names" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(FailedPrecondition, match="model name 'm' != 'other'|model name 'other' != 'm'"):
        WHEN[when](info(), info(weights_fingerprint="", model_name="other"))
    with pytest.raises(FailedPrecondition, match="model name"):
        WHEN[when](info(weights_fingerprint=""), info(model_name="other"))


def test_a_draft_need_not_be_the_targets_model():
    """Rejection sampling is exact for any draft: only its token ids are checked."""
    draft = info(weights_fingerprint="w1:" + "d" * 64, dtype="float32", weights="int8", eos_token_ids=[2],
                 model_name="small")
    C.check_replica_ids(draft, info(), True, ("draft", "target"))
    C.check_replicas(pool(replica(A, info())), pool(replica(B, draft)))
    C.admission(info(), LoopSettings(max_context=1024, max_draft_tokens=8), draft=True)(replica(B, draft))


# ------------------------------------------------------------------ end to end


def engine(model, name="tiny-target"):
    """An engine under one name: a refusal must come from the weights, not the name."""
    return ModelEngine(model, EngineConfig(dtype="float32"), name=name)


def test_replicas_of_two_checkpoints_refuse_to_start(monkeypatch):
    target = tiny_model("llama", seed=0)
    with target_replicas_behind_one_name(monkeypatch, engine(target), engine(fine_tuned(target))) as (port, _, _):
        loop = BackgroundLoop()
        try:
            with pytest.raises(FailedPrecondition, match="target replica .* not the same model: weights fingerprint"):
                orch = start_orchestrator_on_replicas(loop, port)
                loop.run(orch.stop(0))
        finally:
            loop.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("what", ["dtype", "EOS token ids"])
def test_a_replica_of_another_model_that_joins_later_is_refused(what, caplog):
    model = tiny_model("llama", seed=0)
    if what == "dtype":
        other = copy.deepcopy(model).to(torch.bfloat16)
    else:
        other = copy.deepcopy(model)
        other.generation_config.eos_token_id = [2, 5]
    late = _free_port()
    late_address = f"127.0.0.1:{late}"
    loop = BackgroundLoop()
    with running_target(engine(model)) as (svc, _, _), \
            caplog.at_level(logging.WARNING, logger="orchestrator.replicas"):
        try:
            orch = loop.run(S.start_orchestrator(local_config(), OrchestratorConfig(
                target=f"127.0.0.1:{svc.port},{late_address}", draft="", connect_timeout_s=3,
                resolve_interval_s=0.3), tls=TlsConfig(insecure=True)))
            try:
                cfg = local_config()
                cfg.port = late
                with running_target(engine(other), server_cfg=cfg):
                    def refused():
                        return [r.getMessage() for r in caplog.records
                                if f"replica {late_address} refused: " in r.getMessage()]
                    pool = orch.backends.targets
                    wait_until(lambda: refused() or late_address in pool.replicas, 20)
                    time.sleep(0.1)
                    assert late_address not in pool.replicas
                    message = refused()[0]
                    assert f"the new target replica {late_address}" in message, message
                    assert f"target replica 127.0.0.1:{svc.port}" in message and f"{what} " in message, message
            finally:
                loop.run(orch.stop(0))
        finally:
            loop.close()


# ------------------------------------------------------------------ a replica back as another model

def test_a_target_restarted_in_place_as_another_model_takes_no_request():
    """One target at a fixed address stops, and a fine-tune of its model
    starts at the same address: the health loop reads its ModelInfo again
    before marking it up (`ReplicaPool.recheck`), refuses it, and a new
    request fails UNAVAILABLE saying why instead of running on the other
    model. Once the first model is back there, requests are served again,
    as target-only decoding of that model."""
    from orchestrator.client import Client

    model = tiny_model("llama", seed=0)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    prompt = [3, 4, 5, 6]

    def at_port():
        cfg = local_config()
        cfg.port = port
        return cfg

    loop = BackgroundLoop()
    orch = None
    try:
        with running_target(engine(model), server_cfg=at_port()):
            orch = loop.run(S.start_orchestrator(local_config(), OrchestratorConfig(
                target=address, draft="", connect_timeout_s=5, health_interval_s=0.1, target_recovery_s=1),
                tls=TlsConfig(insecure=True)))
            with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                before = client.complete(prompt, max_tokens=12, temperature=0).token_ids
        replica = orch.backends.targets.replicas[address]
        wait_until(lambda: replica.failures > 0, 20)
        with running_target(engine(fine_tuned(model, scale=0.5)), server_cfg=at_port()):
            wait_until(lambda: replica.refusal, 20)
            assert "weights fingerprint" in replica.refusal, replica.refusal
            assert replica.failures > 0  # kept down: new requests avoid it
            with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                with pytest.raises(grpc.RpcError) as refused:
                    client.complete(prompt, max_tokens=12, temperature=0)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "refused" in refused.value.details() and "not the same model" in refused.value.details()
        with running_target(engine(model), server_cfg=at_port()):
            wait_until(lambda: not replica.refusal and replica.failures == 0, 20)
            with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                assert client.complete(prompt, max_tokens=12, temperature=0).token_ids == before
    finally:
        if orch is not None:
            loop.run(orch.stop(0))
        loop.close()


def test_a_recovery_does_not_reopen_on_a_replica_back_as_another_model():
    """A request's target fails; the only other replica is dead, and the
    failed one answers again as another model: the recovery reads its
    ModelInfo before opening there, and the request fails rather than
    continue on the other model."""
    import asyncio

    from orchestrator.recovery import RecoverySettings, TargetLease
    from specdec.errors import Unavailable
    from tests.test_target_recovery import FakeTarget, _Batcher

    class BackAs(FakeTarget):
        """A replica whose ModelInfo, read again, is `model_info`."""

        def __init__(self, label, model_info, **kw):
            super().__init__(label, **kw)
            self.info, self.next_info = info(), model_info

        async def fetch_info(self, timeout):
            self.info = self.next_info
            return self.info

    async def run():
        a = BackAs("a", info(weights_fingerprint="w1:" + "b" * 64))
        b = FakeTarget("b", refuse=grpc.StatusCode.UNAVAILABLE)
        b.info = info()
        p = pool(R.Replica(A, client=a, batcher=_Batcher()), R.Replica(B, client=b, batcher=_Batcher()))
        p.refresh_s, p._resolved_at = 3600, time.monotonic()
        p.replicas[B].active = 5
        p.admit = C.admission(info(), LoopSettings(max_context=1024, max_draft_tokens=8), draft=False,
                              reference_address=A)
        lease = TargetLease(p, RecoverySettings(window_s=0.5, retry_initial_s=0.01, retry_max_s=0.05))
        assert lease.client is a
        session, _ = await a.open(None, 1.0)
        with pytest.raises(Unavailable, match="refused: .*not the same model: weights fingerprint"):
            await lease.reopen(None, None, Unavailable("lane broke"), lambda c, r, t: c.open(r, t))
        assert len(a.requests) == 1, "no session re-opened on the other model"
        assert p.replicas[A].refusal and not p.replicas[B].refusal
        assert p.acquire() is p.replicas[B], "a refused replica gets no request, even with the others down"
        p.replicas[B].refusal = "another model too"
        with pytest.raises(Unavailable, match="every replica of target.svc:1 is refused"):
            p.acquire()
        p.replicas[B].refusal = ""
        # Back as the reference model: admitted again.
        a.next_info = info()
        assert await p.recheck(p.replicas[A], 1.0) is None and not p.replicas[A].refusal

    asyncio.run(run())
