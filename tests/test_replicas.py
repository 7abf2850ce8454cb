"""Requests are pinned to one replica each, and spread over the replicas a
service name resolves to (a Kubernetes headless Service)."""
from __future__ import annotations

import concurrent.futures
import socket

import pytest

from orchestrator.replicas import resolve, split_address
from tests.conftest import tiny_engine
from tests.harness import local_config, running_target


def test_resolve_literals_and_names():
    assert resolve("127.0.0.1:5") == ["127.0.0.1:5"]
    assert resolve("localhost:7") == ["127.0.0.1:7"]
    assert split_address("[::1]:9") == ("::1", 9)
    # A list: the union, in order, without repeats (replicas on one machine).
    assert resolve("127.0.0.1:5, localhost:6,127.0.0.1:5") == ["127.0.0.1:5", "127.0.0.1:6"]
    with pytest.raises(ValueError):
        resolve(" , ")
    with pytest.raises(ValueError):
        split_address("no-port")


def test_requests_spread_over_replicas_and_stay_pinned(monkeypatch):
    # Two target replicas on the same port at two loopback addresses, behind
    # one name, like pods behind a headless Service.
    engine_a, engine_b = tiny_engine(seed=0), tiny_engine(seed=0)
    with running_target(engine_a) as (svc_a, _, _):
        port = svc_a.port
        cfg = local_config()
        cfg.host, cfg.port = "127.0.0.2", port
        with running_target(engine_b, server_cfg=cfg):
            real = socket.getaddrinfo

            def fake(host, *args, **kwargs):
                if host == "target.specdec.svc":
                    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("127.0.0.1", "127.0.0.2")]
                return real(host, *args, **kwargs)

            monkeypatch.setattr(socket, "getaddrinfo", fake)
            from tests.harness import BackgroundLoop
            from orchestrator.client import Client
            from orchestrator.config import OrchestratorConfig
            from orchestrator.server import start_orchestrator
            from specdec.security.tls import TlsConfig

            loop = BackgroundLoop()
            try:
                # A cluster name, so plaintext must be asked for (docs/security.md).
                orch = loop.run(start_orchestrator(local_config(), OrchestratorConfig(
                    target=f"target.specdec.svc:{port}", draft="", connect_timeout_s=10),
                    tls=TlsConfig(insecure=True)))
                assert len(orch.backends.targets.replicas) == 2
                seen = {"a": 0, "b": 0}

                def run(i):
                    with Client(f"127.0.0.1:{orch.port}", timeout_s=60) as client:
                        stream = client.generate([3 + i, 4, 5], max_tokens=200, temperature=0)
                        next(stream)
                        seen["a"] = max(seen["a"], engine_a.num_sessions)
                        seen["b"] = max(seen["b"], engine_b.num_sessions)
                        return list(stream)

                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    list(pool.map(run, range(4)))
                assert seen["a"] >= 1 and seen["b"] >= 1, seen
                loop.run(orch.stop(0))
            finally:
                loop.close()
