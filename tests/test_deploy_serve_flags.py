"""Agreement of the rendered manifests with the `specd` CLI contract: every role runs
`specd serve ROLE` with flags, choices and ports the CLI has, and its init container runs
`specd models fetch` for the model it serves, into the shared model cache.
Shared fixtures and helpers: tests/deploy_manifests.py.
"""
from __future__ import annotations

import re
import shlex

import pytest

from tests.deploy_manifests import (
    CHOICES,
    DEFAULT_METRICS_PORT,
    DEFAULT_PORTS,
    GPU_RENDERS,
    LANE_PORTS,
    MODEL_CACHE,
    MODEL_ROLES,
    RENDERS,
    ROLES,
    ROLE_FLAGS,
    _container_env,
    _container_port,
    _deployment,
    _expand,
    _flags,
    _main_container,
    _named,
    _of_kind,
    _opens,
    _pod_labels,
    _pod_spec,
    _policies_for,
    _serve_settings,
)


@pytest.mark.parametrize("render", RENDERS)
def test_manifests_use_only_flags_and_ports_of_the_cli_contract(rendered, render):
    objects = rendered[render]
    services = {s["metadata"]["name"]: s for s in _of_kind(objects, "Service")}
    for role in ROLES:
        deployment = _deployment(objects, role)
        container = _main_container(deployment)
        env = _container_env(objects, container)
        settings = _serve_settings(objects, role)
        unknown = set(settings) - ROLE_FLAGS[role]
        assert not unknown, f"{role}: not flags of `specd serve {role}`: {sorted(unknown)}"
        for flag, value in settings.items():
            assert "$(" not in value, f"{role} {flag}={value}: unresolved variable"
            if flag in CHOICES:
                assert CHOICES[flag].fullmatch(value), f"{role} {flag}={value!r} is not a valid choice"
        assert int(settings.get("--port", DEFAULT_PORTS[role])) == DEFAULT_PORTS[role]
        assert settings.get("--host") in ("0.0.0.0", "::", "[::]"), f"{role} must bind every interface in a pod"
        metrics = int(settings.get("--metrics-port", DEFAULT_METRICS_PORT))
        assert metrics == DEFAULT_METRICS_PORT == _container_port(container, "metrics")
        assert _container_port(container, "grpc") == DEFAULT_PORTS[role]
        assert env.get("SPECD_CACHE_DIR") == MODEL_CACHE
        # Tracing: each role names itself and exports to the in-namespace collector.
        assert env.get("OTEL_SERVICE_NAME") == f"specdec-{role}"
        endpoint = re.fullmatch(r"https?://([\w.-]+):(\d+)", env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
        assert endpoint, f"{role}: OTEL_EXPORTER_OTLP_ENDPOINT"
        collector = services[endpoint.group(1).split(".")[0]]
        assert int(endpoint.group(2)) in {p["port"] for p in collector["spec"]["ports"]}
        assert env.get("SPECD_TRACING", "on") != "off"
    orchestrator = _serve_settings(objects, "orchestrator")
    # The OpenAI-compatible HTTP API: the flag, the container port, the Service port, open to clients.
    http_port = int(orchestrator["--http-port"])
    orchestrator_container = _main_container(_deployment(objects, "orchestrator"))
    assert _container_port(orchestrator_container, "http") == http_port
    named = {p["name"]: p for p in services["specdec-orchestrator"]["spec"]["ports"]}
    assert _container_port(orchestrator_container, named["http"]["targetPort"]) == http_port
    rules = [r for p in _policies_for(objects, _pod_labels(_deployment(objects, "orchestrator")))
             for r in p["spec"].get("ingress", [])]
    assert any(not r.get("from") and _opens(r, orchestrator_container, http_port) for r in rules)
    for role in MODEL_ROLES:
        host, port = orchestrator[f"--{role}"].rsplit(":", 1)
        service = services[host.split(".")[0]]
        assert service["metadata"]["name"] == f"specdec-{role}"
        assert int(port) == DEFAULT_PORTS[role] in {p["port"] for p in service["spec"]["ports"]}
        # The lane: a fixed port (a free one would not be in the Service or the NetworkPolicy),
        # exposed by the container and the headless Service the orchestrator resolves.
        lane = int(_serve_settings(objects, role)["--lane-port"])
        assert lane == LANE_PORTS[role] == _container_port(_main_container(_deployment(objects, role)), "lane")
        assert lane in {p["port"] for p in service["spec"]["ports"]}
    assert orchestrator["--tokenizer"] == _serve_settings(objects, "target")["--model"]


def _fetch_invocation(objects: list[dict], deployment: dict) -> tuple[list[str], dict[str, str], dict]:
    inits = [c for c in _pod_spec(deployment).get("initContainers", []) if c["name"] == "fetch-model"]
    assert len(inits) == 1, f"{deployment['metadata']['name']} has no fetch-model init container"
    init = inits[0]
    env = _container_env(objects, init)
    script = " ".join(init.get("command", []) + init.get("args", []))
    match = re.search(r"specd models fetch ([^;\n]*)", script)
    assert match, f"the init container does not run `specd models fetch`: {script}"
    words = [_expand(word, env) for word in shlex.split(match.group(1))]
    return [re.sub(r"^\$(\w+)$|^\$\{(\w+)\}$", lambda m: env[m.group(1) or m.group(2)], w) for w in words], env, init


@pytest.mark.parametrize("render", RENDERS)
def test_init_containers_fetch_the_served_model_into_the_shared_volume(rendered, render):
    objects = rendered[render]
    for role in ROLES:
        deployment = _deployment(objects, role)
        words, env, init = _fetch_invocation(objects, deployment)
        settings = _serve_settings(objects, role)
        served = settings["--tokenizer"] if role == "orchestrator" else settings["--model"]
        assert words[0] == served, f"{role}: fetches {words[0]!r} but serves {served!r}"
        assert _flags(words[1:]) == {"--cache-dir": MODEL_CACHE}
        assert init["image"] == _main_container(deployment)["image"], "the init container uses the same image"
        init_mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
        main_mounts = {m["mountPath"]: m for m in _main_container(deployment)["volumeMounts"]}
        assert init_mounts[MODEL_CACHE]["name"] == main_mounts[MODEL_CACHE]["name"]
        assert not init_mounts[MODEL_CACHE].get("readOnly")
        volumes = {v["name"]: v for v in _pod_spec(deployment)["volumes"]}
        volume = volumes[main_mounts[MODEL_CACHE]["name"]]
        expected = "persistentVolumeClaim" if render in GPU_RENDERS else "emptyDir"
        assert expected in volume, f"{role}: the model cache should be a {expected} in {render}"
        if expected == "persistentVolumeClaim":
            _named(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
