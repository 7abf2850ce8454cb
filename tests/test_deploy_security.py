"""Security in the rendered manifests: non-root pods with a read-only root, pinned image tags,
plaintext only where --insecure says so, the mtls component's certificates and name checks, and
the api-keys component's Secret.
Shared fixtures and helpers: tests/deploy_manifests.py.
"""
from __future__ import annotations

import re

import pytest

from tests.deploy_manifests import (
    API_KEY_RENDERS,
    DEFAULT_METRICS_PORT,
    DEFAULT_PORTS,
    IMAGE,
    MODEL_ROLES,
    MTLS_RENDERS,
    PLAINTEXT_RENDERS,
    RENDERS,
    ROLES,
    _all_containers,
    _container_port,
    _deployment,
    _main_container,
    _of_kind,
    _pod_spec,
    _serve_settings,
)


@pytest.mark.parametrize("render", RENDERS)
def test_every_pod_is_non_root_with_a_read_only_root(rendered, render):
    for deployment in _of_kind(rendered[render], "Deployment"):
        name = deployment["metadata"]["name"]
        spec = _pod_spec(deployment)
        pod = spec.get("securityContext", {})
        assert spec.get("automountServiceAccountToken") is False, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in _all_containers(deployment):
            where = f"{name}/{container['name']}"
            sc = {**pod, **container.get("securityContext", {})}
            assert sc.get("runAsNonRoot") is True, f"{where} may run as root"
            assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0, f"{where} needs a numeric UID"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where} has a writable root filesystem"
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert not sc.get("privileged"), where
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), f"{where} keeps capabilities"
            assert not sc.get("capabilities", {}).get("add"), where
            assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
            # The writable places a read-only root needs are emptyDirs.
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], f"{where}: /tmp is not writable"
            if deployment["metadata"]["name"].startswith("specdec-"):
                assert "emptyDir" in volumes[mounts["/cache"]], f"{where}: /cache (HF/torch caches) not writable"


@pytest.mark.parametrize("render", RENDERS)
def test_every_image_has_a_pinned_tag(rendered, render):
    for deployment in _of_kind(rendered[render], "Deployment"):
        for container in _all_containers(deployment):
            image = container["image"]
            if "@sha256:" in image:
                continue
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag, f"{image}: no tag"
            assert tag != "latest", f"{image}: the latest tag is not a pin"
            if name == IMAGE:
                assert re.fullmatch(r"\d+\.\d+\.\d+(-[a-z0-9.]+)?", tag), f"{image}: not a version tag"
            assert container.get("imagePullPolicy") in (None, "IfNotPresent"), image


@pytest.mark.parametrize("render", PLAINTEXT_RENDERS)
def test_plaintext_renders_say_so_explicitly(rendered, render):
    # A role bound to 0.0.0.0 refuses plaintext unless --insecure says it is meant.
    for role in ROLES:
        settings = _serve_settings(rendered[render], role)
        assert settings.get("--insecure") == "true", f"{role}: plaintext in {render} without --insecure"
        assert not any(settings.get(flag) for flag in ("--tls-cert", "--tls-ca", "--downstream-ca")), role


def _secret_of_file(deployment: dict, path: str) -> str:
    """The Secret a file path of the main container is mounted from."""
    container = _main_container(deployment)
    volumes = {v["name"]: v for v in _pod_spec(deployment)["volumes"]}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            volume = volumes[mount["name"]]
            assert "secret" in volume, f"{path} is not mounted from a Secret"
            assert mount.get("readOnly"), f"{path}: the Secret must be mounted read-only"
            return volume["secret"]["secretName"]
    raise AssertionError(f"{deployment['metadata']['name']}: nothing mounted at {path}")


def _certificates(objects: list[dict]) -> dict[str, dict]:
    """cert-manager Certificates by the Secret they fill."""
    return {c["spec"]["secretName"]: c for c in _of_kind(objects, "Certificate")}


@pytest.mark.parametrize("render", MTLS_RENDERS)
def test_mtls_component_gives_every_role_its_certificate_and_checks_names(rendered, render):
    objects = rendered[render]
    certificates = _certificates(objects)
    issuers = {i["metadata"]["name"]: i for i in _of_kind(objects, "Issuer")}
    for certificate in certificates.values():
        issuer = certificate["spec"]["issuerRef"]
        assert issuer["kind"] == "Issuer" and issuer["name"] in issuers, certificate["metadata"]["name"]
        ca_secret = issuers[issuer["name"]]["spec"].get("ca", {}).get("secretName")
        assert ca_secret is None or certificates[ca_secret]["spec"]["isCA"] is True
    orchestrator = _serve_settings(objects, "orchestrator")
    own = certificates[_secret_of_file(_deployment(objects, "orchestrator"), orchestrator["--tls-cert"])]["spec"]
    for role in ROLES:
        deployment = _deployment(objects, role)
        settings = _serve_settings(objects, role)
        assert settings.get("--insecure") == "false", f"{role}: plaintext must be refused"
        secret = _secret_of_file(deployment, settings["--tls-cert"])
        assert _secret_of_file(deployment, settings["--tls-key"]) == secret
        assert secret in certificates, f"{role}: no Certificate fills the Secret {secret}"
        spec = certificates[secret]["spec"]
        if role in MODEL_ROLES:
            # Mutual TLS, serving only the orchestrator's certificate name...
            assert _secret_of_file(deployment, settings["--tls-ca"]) == secret
            allowed = settings.get("--allowed-callers", "orchestrator").split(",")
            assert own["commonName"] in allowed and "client auth" in own["usages"]
            # ...which dials each pod by IP and checks the Service's name in its certificate.
            host = orchestrator[f"--{role}"].rsplit(":", 1)[0]
            assert host in spec["dnsNames"], f"{role}: the certificate does not name {host}"
            assert "server auth" in spec["usages"]
        else:
            assert "--tls-ca" not in settings, "clients of the orchestrator need no certificate"
            for flag in ("--downstream-ca", "--downstream-cert", "--downstream-key"):
                assert _secret_of_file(deployment, orchestrator[flag]) == secret, flag
        # Probes cannot present a client certificate: the plaintext health-only port.
        health = int(settings["--health-port"])
        assert health not in (DEFAULT_PORTS[role], DEFAULT_METRICS_PORT)
        assert _container_port(_main_container(deployment), "health") == health


@pytest.mark.parametrize("render", API_KEY_RENDERS)
def test_api_keys_component_reads_the_keys_from_a_secret(rendered, render):
    objects = rendered[render]
    deployment = _deployment(objects, "orchestrator")
    settings = _serve_settings(objects, "orchestrator")
    assert _secret_of_file(deployment, settings["--api-key-file"]) == "specdec-api-keys"
    for role in MODEL_ROLES:
        assert "--api-key-file" not in _serve_settings(objects, role)
