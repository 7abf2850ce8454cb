"""Networking in the rendered manifests: headless Services for the model roles, NetworkPolicies
that let only the orchestrator reach draft and target, clients the orchestrator and every role
the trace collector, Prometheus the metrics ports only, and the collector's pipeline.
Shared fixtures and helpers: tests/deploy_manifests.py.
"""
from __future__ import annotations

import re

import pytest
import yaml  # PyYAML: a test dependency (kubernetes-validate needs it too)

from tests.deploy_manifests import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PORTS,
    MODEL_ROLES,
    PROMETHEUS_RENDERS,
    RENDERS,
    ROLES,
    _config_map,
    _container_env,
    _container_port,
    _deployment,
    _main_container,
    _named,
    _of_kind,
    _opens,
    _pod_labels,
    _policies_for,
    _rule_ports,
    _selects,
    _serve_settings,
)


@pytest.mark.parametrize("render", RENDERS)
def test_model_services_are_headless_and_the_orchestrator_is_not(rendered, render):
    objects = rendered[render]
    for role in ROLES:
        service = _named(objects, "Service", f"specdec-{role}")
        container = _main_container(_deployment(objects, role))
        if role in MODEL_ROLES:
            # Session pinning: DNS must list every replica, not one virtual IP.
            assert service["spec"].get("clusterIP") == "None", f"{role} Service must be headless"
            assert not service["spec"].get("publishNotReadyAddresses"), f"{role}: unready replicas in DNS"
        else:
            assert service["spec"].get("clusterIP") != "None"
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["grpc"]["port"] == DEFAULT_PORTS[role]
        assert _container_port(container, ports["grpc"].get("targetPort", ports["grpc"]["port"])) == DEFAULT_PORTS[role]


@pytest.mark.parametrize("render", RENDERS)
def test_only_orchestrator_pods_reach_draft_and_target(rendered, render):
    objects = rendered[render]
    orchestrator_labels = _pod_labels(_deployment(objects, "orchestrator"))
    other_pods = [_pod_labels(d) for d in _of_kind(objects, "Deployment") if _pod_labels(d) != orchestrator_labels]
    for role in MODEL_ROLES:
        deployment = _deployment(objects, role)
        container = _main_container(deployment)
        policies = _policies_for(objects, _pod_labels(deployment))
        assert policies, f"no NetworkPolicy isolates {role} pods"
        # The gRPC port and the lane (the round's call on a TCP connection, specdec/rpc/lane.py).
        for port in (DEFAULT_PORTS[role], int(_serve_settings(objects, role)["--lane-port"])):
            admitted = False
            for policy in policies:
                for rule in policy["spec"].get("ingress", []):
                    ports = _rule_ports(rule, container)
                    if ports is not None and port not in ports:
                        continue
                    where = f"NetworkPolicy {policy['metadata']['name']} -> {role}:{port}"
                    peers = rule.get("from")
                    assert peers, f"{where} admits every source"
                    for peer in peers:
                        assert set(peer) == {"podSelector"}, f"{where} admits {peer} (namespaces or IP blocks)"
                        assert _selects(peer["podSelector"], orchestrator_labels), f"{where}: {peer}"
                        for labels in other_pods:
                            assert not _selects(peer["podSelector"], labels), f"{where} admits pods {labels}"
                    admitted = True
            assert admitted, f"the orchestrator cannot reach {role}:{port}"


@pytest.mark.parametrize("render", RENDERS)
def test_clients_reach_the_orchestrator_and_roles_reach_the_collector(rendered, render):
    objects = rendered[render]
    orchestrator = _deployment(objects, "orchestrator")
    rules = [r for p in _policies_for(objects, _pod_labels(orchestrator)) for r in p["spec"].get("ingress", [])]
    assert any(
        not rule.get("from") and _opens(rule, _main_container(orchestrator), DEFAULT_PORTS["orchestrator"])
        for rule in rules
    ), "clients cannot reach the orchestrator's gRPC port"
    collector = _named(objects, "Deployment", "otel-collector")
    rules = [r for p in _policies_for(objects, _pod_labels(collector)) for r in p["spec"].get("ingress", [])]
    for role in ROLES:
        labels = _pod_labels(_deployment(objects, role))
        assert any(
            _opens(rule, _main_container(collector), 4317)
            and any("podSelector" in peer and _selects(peer["podSelector"], labels) for peer in rule.get("from", []))
            for rule in rules
        ), f"{role} cannot send traces to the collector"


@pytest.mark.parametrize("render", PROMETHEUS_RENDERS)
def test_prometheus_component_scrapes_metrics_ports_only(rendered, render):
    objects = rendered[render]
    monitors = _of_kind(objects, "ServiceMonitor")
    assert len(monitors) == 1
    monitor = monitors[0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for role in ROLES:
        service = _named(objects, "Service", f"specdec-{role}")
        assert _selects(monitor["spec"]["selector"], service["metadata"]["labels"]), f"{role} Service not scraped"
        named = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert endpoint_ports <= set(named), f"{role} Service lacks port(s) {endpoint_ports - set(named)}"
        assert {named[p] for p in endpoint_ports} == {DEFAULT_METRICS_PORT}
        deployment = _deployment(objects, role)
        assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(
            DEFAULT_METRICS_PORT
        )
        # The monitoring namespace may reach the metrics port, and only that one.
        container = _main_container(deployment)
        from_monitoring = [
            rule for policy in _policies_for(objects, _pod_labels(deployment))
            for rule in policy["spec"].get("ingress", [])
            if any("namespaceSelector" in peer for peer in rule.get("from", []))
        ]  # fmt: skip
        assert from_monitoring, f"Prometheus cannot reach {role}"
        for rule in from_monitoring:
            assert _rule_ports(rule, container) == {DEFAULT_METRICS_PORT}, rule


@pytest.mark.parametrize("render", RENDERS)
def test_collector_receives_otlp_and_exports_to_debug_and_a_backend(rendered, render):
    objects = rendered[render]
    config = yaml.safe_load(_config_map(objects, "otel-collector-config")["data"]["config.yaml"])
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    traces = config["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    assert "debug" in traces["exporters"]
    assert any(name.startswith("otlp/") or name == "otlp" for name in traces["exporters"])
    collector = _named(objects, "Deployment", "otel-collector")
    container = _main_container(collector)
    env = _container_env(objects, container)
    for name in re.findall(r"\$\{env:(\w+)\}", _config_map(objects, "otel-collector-config")["data"]["config.yaml"]):
        assert name in env, f"collector config uses ${{env:{name}}}, which nothing sets"
    service = _named(objects, "Service", "otel-collector")
    assert {p["port"] for p in service["spec"]["ports"]} >= {4317, 4318}
