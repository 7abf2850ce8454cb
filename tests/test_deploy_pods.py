"""The role pods in the rendered manifests: whole GPUs on GPU nodes (none on cpu-dev), draft and
target on different nodes, gRPC probes with room for a model's startup, a termination grace that
outlasts the drain, and CPU and memory requests and limits.
Shared fixtures and helpers: tests/deploy_manifests.py.
"""
from __future__ import annotations

import re

import pytest

from tests.deploy_manifests import (
    CPU_RENDERS,
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_PORTS,
    DRAIN_MARGIN_S,
    GPU,
    GPU_RENDERS,
    HEALTH_SERVICES,
    MODEL_ROLES,
    MODEL_STARTUP_BUDGET_S,
    MTLS_RENDERS,
    ORCHESTRATOR_STARTUP_BUDGET_S,
    RENDERS,
    ROLES,
    _all_containers,
    _container_port,
    _deployment,
    _main_container,
    _named,
    _of_kind,
    _pod_labels,
    _pod_spec,
    _prestop_sleep_s,
    _quantity,
    _selects,
    _serve_settings,
)


@pytest.mark.parametrize("render", RENDERS)
def test_gpu_limits_are_whole_and_equal_requests(rendered, render):
    for deployment in _of_kind(rendered[render], "Deployment"):
        for container in _all_containers(deployment):
            resources = container.get("resources", {})
            limit = resources.get("limits", {}).get(GPU)
            request = resources.get("requests", {}).get(GPU)
            if limit is None and request is None:
                continue
            where = f"{deployment['metadata']['name']}/{container['name']}"
            assert limit is not None, f"{where}: a GPU request needs the same limit"
            assert re.fullmatch(r"[0-9]+", str(limit)), f"{where}: GPU limit {limit!r} is not a whole number"
            assert request is None or str(request) == str(limit), f"{where}: GPU request {request} != limit {limit}"


def _gpus(deployment: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get(GPU, 0)) for c in _pod_spec(deployment)["containers"])


@pytest.mark.parametrize("render", GPU_RENDERS)
def test_gpu_overlay_gives_draft_and_target_one_gpu_each_on_gpu_nodes(rendered, render):
    objects = rendered[render]
    for role in MODEL_ROLES:
        deployment = _deployment(objects, role)
        spec = _pod_spec(deployment)
        assert _gpus(deployment) == 1, f"{role} must request exactly one GPU"
        for init in spec.get("initContainers", []):
            assert GPU not in init.get("resources", {}).get("limits", {}), f"{role} init container holds a GPU"
        assert any(t.get("key") == GPU and t.get("effect") == "NoSchedule" for t in spec.get("tolerations", [])), role
        assert spec.get("nodeSelector"), f"{role} has no GPU node selector"
        assert re.fullmatch(r"cuda(:\d+)?", _serve_settings(objects, role)["--device"]), role
    for name in ("specdec-orchestrator", "otel-collector"):
        assert _gpus(_named(objects, "Deployment", name)) == 0, f"{name} must not take a GPU"


@pytest.mark.parametrize("render", CPU_RENDERS)
def test_cpu_dev_overlay_runs_on_cpu(rendered, render):
    objects = rendered[render]
    for deployment in _of_kind(objects, "Deployment"):
        assert _gpus(deployment) == 0
    for role in MODEL_ROLES:
        assert _serve_settings(objects, role)["--device"] == "cpu"
        # Fits a one-node dev cluster: nothing *requires* separate nodes.
        affinity = _pod_spec(_deployment(objects, role)).get("affinity", {})
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity.get("podAntiAffinity", {})


@pytest.mark.parametrize("render", GPU_RENDERS)
def test_draft_and_target_are_kept_on_different_nodes(rendered, render):
    objects = rendered[render]
    for role, other in (("draft", "target"), ("target", "draft")):
        terms = _pod_spec(_deployment(objects, role))["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        other_labels = _pod_labels(_deployment(objects, other))
        assert any(
            term["topologyKey"] == "kubernetes.io/hostname" and _selects(term["labelSelector"], other_labels)
            for term in terms
        ), f"{role} has no required anti-affinity against {other} pods"


@pytest.mark.parametrize("render", RENDERS)
def test_every_role_has_grpc_probes_on_an_exposed_port(rendered, render):
    objects = rendered[render]
    for role in ROLES:
        deployment = _deployment(objects, role)
        # Under mutual TLS kubelet's probes (plaintext, no client certificate) use the
        # plaintext health-only port; otherwise the gRPC port itself.
        settings = _serve_settings(objects, role)
        probed = int(settings["--health-port"]) if render in MTLS_RENDERS else DEFAULT_PORTS[role]
        for container in _pod_spec(deployment)["containers"]:
            where = f"{role}/{container['name']}"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                assert probe and "grpc" in probe, f"{where} has no gRPC {kind}"
                port = probe["grpc"]["port"]
                assert isinstance(port, int), f"{where} {kind}: port {port!r} is not an integer"
                assert port == _container_port(container, port) == probed
                service = probe["grpc"].get("service", "")
                allowed = {HEALTH_SERVICES[role]} | ({""} if kind == "livenessProbe" else set())
                assert service in allowed, f"{where} {kind} checks {service!r}"
            startup = container["startupProbe"]
            budget = startup.get("failureThreshold", 3) * startup.get("periodSeconds", 10)
            needed = MODEL_STARTUP_BUDGET_S if role in MODEL_ROLES else ORCHESTRATOR_STARTUP_BUDGET_S
            assert budget >= needed, f"{where}: startup budget {budget}s < {needed}s"
            # A draining pod reports NOT_SERVING: liveness must not kill it before it is done.
            liveness = container["livenessProbe"]
            grace = _pod_spec(deployment)["terminationGracePeriodSeconds"]
            assert liveness.get("failureThreshold", 3) * liveness.get("periodSeconds", 10) > grace, where
        assert deployment["spec"].get("progressDeadlineSeconds", 600) >= (
            MODEL_STARTUP_BUDGET_S if role in MODEL_ROLES else 600
        )


@pytest.mark.parametrize("render", RENDERS)
def test_termination_grace_outlasts_the_drain(rendered, render):
    objects = rendered[render]
    for role in ROLES:
        deployment = _deployment(objects, role)
        drain = float(_serve_settings(objects, role).get("--drain-grace-s", DEFAULT_DRAIN_GRACE_S))
        grace = _pod_spec(deployment).get("terminationGracePeriodSeconds", 30)
        for container in _pod_spec(deployment)["containers"]:
            needed = _prestop_sleep_s(container) + drain + DRAIN_MARGIN_S
            assert grace >= needed, f"{role}: terminationGracePeriodSeconds {grace} < {needed}"


@pytest.mark.parametrize("render", RENDERS)
def test_every_container_has_requests_and_limits(rendered, render):
    for deployment in _of_kind(rendered[render], "Deployment"):
        for container in _all_containers(deployment):
            where = f"{deployment['metadata']['name']}/{container['name']}"
            resources = container.get("resources", {})
            for resource in ("cpu", "memory"):
                request = resources.get("requests", {}).get(resource)
                limit = resources.get("limits", {}).get(resource)
                assert request is not None and limit is not None, f"{where}: {resource} request and limit"
                assert _quantity(request) <= _quantity(limit), f"{where}: {resource} request > limit"


@pytest.mark.parametrize("render", GPU_RENDERS)
def test_on_gpu_nodes_every_role_may_busy_poll_by_default(rendered, render):
    # Busy polling's auto default (specdec/busy_poll.py) turns on only in a process that may
    # use AUTO_MIN_CPUS CPUs: each role's CPU limit (its cgroup quota) must let it.
    from specdec import busy_poll

    objects = rendered[render]
    for role in ROLES:
        assert int(_serve_settings(objects, role)["--busy-poll-us"]) == busy_poll.AUTO, role
        limit = _main_container(_deployment(objects, role))["resources"]["limits"]["cpu"]
        assert int(_quantity(limit)) >= busy_poll.AUTO_MIN_CPUS, f"{role}: a CPU limit of {limit} keeps it from polling"
