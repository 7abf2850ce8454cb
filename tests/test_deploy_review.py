"""The rendered manifests against the real `specd` command line and the running code, where
tests/deploy_manifests.py holds a hand-written contract: each role's args and SPECD_* environment
as `specd`'s own parser reads them and as the role checks them before it binds; the orchestrator's
wait for its backends against the probes that would restart it; the init containers' `specd models
fetch`; and the mtls component's CA renewal against the copies of the CA each role trusts.
Shared fixtures and helpers: tests/deploy_manifests.py.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest

from tests.deploy_manifests import (
    ENV_ONLY,
    MODEL_ROLES,
    MODEL_STARTUP_BUDGET_S,
    MTLS_RENDERS,
    RENDERS,
    ROLES,
    ROOT,
    _container_env,
    _deployment,
    _expand,
    _main_container,
    _of_kind,
    _pod_spec,
)

# What `specd serve ROLE` builds from its flags before anything binds (specdec/cli/serve_cmd.py).
_ROLE_CONFIGS = {
    "draft": ("ServerConfig", "EngineConfig", "SessionLimits", "DrafterConfig"),
    "target": ("ServerConfig", "EngineConfig", "SessionLimits"),
    "orchestrator": ("ServerConfig", "OrchestratorConfig", "HttpConfig"),
}


def _config_classes() -> dict[str, type]:
    from draft_service.config import DrafterConfig
    from orchestrator.config import OrchestratorConfig
    from orchestrator.openai_api.config import HttpConfig
    from specdec.engine.config import EngineConfig
    from specdec.rpc.serving import ServerConfig
    from specdec.rpc.session_limits import SessionLimits

    return {cls.__name__: cls for cls in (ServerConfig, EngineConfig, SessionLimits, DrafterConfig,
                                         OrchestratorConfig, HttpConfig)}


def _parse_with_specd(monkeypatch, argv: list[str], env: dict[str, str]):
    """`specd ARGV` as the container runs it: the real parser, built (its SPECD_* defaults are read
    then) in the container's environment rather than this process's."""
    from specdec.cli.main import build_parser

    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("SPECD_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        parser = build_parser()
        try:
            return parser, parser.parse_args(argv)
        except SystemExit as exc:  # argparse's error(): an unknown flag, a bad value or a bad SPECD_* variable
            raise AssertionError(f"`specd {shlex.join(argv)}` exits {exc.code} in that environment "
                                 "(see the captured stderr)") from None


def _dests(parser, argv_prefix: list[str]) -> set[str]:
    """The option destinations of the subcommand `argv_prefix` (e.g. serve draft)."""
    for word in argv_prefix:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return {a.dest for a in parser._actions if a.option_strings}


def _mounted_secret_file(deployment: dict, path: str) -> bool:
    container = _main_container(deployment)
    volumes = {v["name"]: v for v in _pod_spec(deployment)["volumes"]}
    return any(path.startswith(m["mountPath"].rstrip("/") + "/") and "secret" in volumes[m["name"]]
               for m in container.get("volumeMounts", []))


@pytest.mark.parametrize("render", RENDERS)
def test_every_role_passes_the_real_cli_and_its_checks_before_binding(rendered, render, monkeypatch):
    """The hard-coded contract (ROLE_FLAGS, CHOICES) can drift from the CLI: here each role's args,
    $(VAR)s expanded, and its SPECD_* environment go through `specd`'s own parser, then through the
    checks `specd serve ROLE` runs before it binds (ports, durations, choices, TLS pairing, and
    plaintext only where --insecure allows it). A SPECD_* variable no flag of the role reads is
    ignored by the CLI without a word: it must be one of its flags or a setting the code reads."""
    from orchestrator.security import downstream_dialer
    from specdec.cli import serve_cmd
    from specdec.config import env_name, from_args
    from specdec.security import tls as tls_module
    from specdec.security.tls import TlsConfig

    objects = rendered[render]
    classes = _config_classes()
    for role in ROLES:
        deployment = _deployment(objects, role)
        container = _main_container(deployment)
        env = _container_env(objects, container)
        argv = [_expand(arg, env) for arg in container["args"]]
        parser, args = _parse_with_specd(monkeypatch, argv, env)
        assert args.role == role

        read = {env_name(dest) for dest in _dests(parser, ["serve", role])} | ENV_ONLY
        ignored = sorted(name for name in env if name.startswith("SPECD_") and name not in read)
        assert not ignored, f"{render} {role}: `specd serve {role}` reads no {ignored}"

        configs = serve_cmd._settings(args, role, *(classes[name] for name in _ROLE_CONFIGS[role]))
        assert configs is not None, f"{render} {role}: `specd serve {role}` refuses its settings (stderr above)"
        by_name = {type(cfg).__name__: cfg for cfg in configs}
        if "EngineConfig" in by_name:
            by_name["EngineConfig"].validate()

        # TLS as the role checks it; the certificate files must come from a mounted Secret.
        with monkeypatch.context() as patch:
            def read_pem(path, what, deployment=deployment):
                assert _mounted_secret_file(deployment, path), f"{render} {role}: {what} {path} is not mounted"
                return b"-----BEGIN CERTIFICATE-----\n"

            patch.setattr(tls_module, "read_pem", read_pem)
            server_tls = from_args(TlsConfig, args)
            server_tls.validate(by_name["ServerConfig"].host, role, require_client_certs=role in MODEL_ROLES)
            if role == "orchestrator":
                downstream_dialer(by_name["OrchestratorConfig"], server_tls.insecure)


@pytest.mark.parametrize("render", RENDERS)
def test_the_orchestrator_waits_for_its_backends_as_long_as_they_may_take(rendered, render, monkeypatch):
    """At start-up the orchestrator waits --connect-timeout-s for one replica of each service, then
    exits. Shorter than a model service's start-up (fetch aside: load and warm-up, what its startup
    probe allows) and a first rollout restarts it while its targets are still loading; longer than
    its own startup probe, and kubelet kills it first, mid-wait."""
    from specdec.config import from_args

    objects = rendered[render]
    container = _main_container(_deployment(objects, "orchestrator"))
    env = _container_env(objects, container)
    _, args = _parse_with_specd(monkeypatch, [_expand(a, env) for a in container["args"]], env)
    connect_s = from_args(_config_classes()["OrchestratorConfig"], args).connect_timeout_s
    startup = container["startupProbe"]
    budget = startup.get("failureThreshold", 3) * startup.get("periodSeconds", 10)
    assert connect_s <= budget, f"{render}: --connect-timeout-s {connect_s} outlasts the startup probe ({budget} s)"
    for role in MODEL_ROLES:
        probe = _main_container(_deployment(objects, role))["startupProbe"]
        model_budget = probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)
        assert connect_s >= min(model_budget, MODEL_STARTUP_BUDGET_S), (
            f"{render}: --connect-timeout-s {connect_s} is shorter than {role}'s start-up ({model_budget} s)")


@pytest.mark.parametrize("render", RENDERS)
def test_fetch_init_containers_run_a_fetch_the_cli_accepts(rendered, render, monkeypatch):
    """The init script fetches any MODEL but an absolute path (`case "$MODEL" in /*)`): a catalog
    name is all `specd models fetch` can fetch, so the model is one of those or an absolute path."""
    from specdec.models.catalog import CATALOG

    objects = rendered[render]
    for role in ROLES:
        deployment = _deployment(objects, role)
        init = next(c for c in _pod_spec(deployment)["initContainers"] if c["name"] == "fetch-model")
        env = _container_env(objects, init)
        model = env["MODEL"]
        assert model in CATALOG or model.startswith("/"), (
            f"{render} {role}: MODEL={model!r} is neither a catalog name ({', '.join(CATALOG)}) nor an absolute path")
        script = " ".join(init["args"])
        fetch = re.search(r"specd (models fetch [^;\n]*)", script).group(1)
        argv = [re.sub(r'^"?\$\{?(\w+)\}?"?$', lambda m: env[m.group(1)], word) for word in shlex.split(fetch)]
        _, args = _parse_with_specd(monkeypatch, argv, env)
        assert args.cache_dir == "/models"


_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|m|s)")


def _hours(duration: str) -> float:
    """A cert-manager (Go) duration such as 2160h or 1h30m, in hours."""
    assert _GO_DURATION.sub("", duration) == "", f"not a duration: {duration!r}"
    scale = {"h": 1, "m": 1 / 60, "s": 1 / 3600}
    return sum(float(n) * scale[u] for n, u in _GO_DURATION.findall(duration))


@pytest.mark.parametrize("render", MTLS_RENDERS)
def test_mtls_ca_renewal_keeps_every_role_trusting_every_other(rendered, render):
    """Each role verifies its peers against the copy of the CA certificate put into its own Secret
    (ca.crt) when its certificate was issued, and cert-manager does not re-issue the roles'
    certificates when the CA renews. A CA renewed with a new key would split the roles into those
    re-issued since (trusting only the new key) and the others, refusing each other's handshakes
    for up to a role certificate's renewal interval; renewed with the same key, old and new CA
    certificates verify the same certificates, provided every copy is refreshed (every role
    certificate renewed) before the old CA certificate expires."""
    objects = rendered[render]
    certificates = {c["metadata"]["name"]: c["spec"] for c in _of_kind(objects, "Certificate")}
    issuers = {i["metadata"]["name"]: i["spec"] for i in _of_kind(objects, "Issuer")}
    cas = {name: spec for name, spec in certificates.items() if spec.get("isCA")}
    assert cas, "no CA Certificate"
    for ca_name, ca in cas.items():
        assert ca.get("privateKey", {}).get("rotationPolicy") == "Never", (
            f"{ca_name}: a CA renewed with a new key breaks trust between the roles until each is re-issued")
        signed = [
            (name, spec) for name, spec in certificates.items()
            if issuers[spec["issuerRef"]["name"]].get("ca", {}).get("secretName") == ca["secretName"]
        ]  # fmt: skip
        assert signed, f"{ca_name} signs nothing"
        for name, spec in signed:
            assert "duration" in spec and "renewBefore" in spec, f"{name}: say when it renews"
            keeps_copy_h = _hours(spec["duration"]) - _hours(spec["renewBefore"])
            assert _hours(ca["renewBefore"]) > keeps_copy_h, (
                f"{name} renews only every {keeps_copy_h:.0f} h, so its copy of {ca_name} may outlive the CA "
                f"certificate it copied (renewed {ca['renewBefore']} before it expires)")
            assert _hours(spec["duration"]) < _hours(ca["duration"]), f"{name} outlives its CA"


def test_env_only_settings_are_read_by_the_code():
    """ENV_ONLY names SPECD_* variables the manifests may set that are not flags: each must be read."""
    sources = [p for d in ("specdec", "orchestrator", "draft_service", "target_service")
               for p in (ROOT / d).rglob("*.py")]  # fmt: skip
    text = "\n".join(Path(p).read_text() for p in sources)
    for name in ENV_ONLY:
        assert re.search(rf"[\"']{name}[\"']", text), f"no code reads {name}"


def test_the_hand_written_cli_contract_is_the_codes():
    """tests/deploy_manifests.py's contract, which the other deploy tests hold the manifests to,
    against the code it copies: role ports, health service names, the drain default, and flags
    every one of which `specd serve ROLE` accepts."""
    from draft_service.config import DEFAULT_PORT as DRAFT_PORT
    from draft_service.server import SERVICE_NAME as DRAFT_SERVICE
    from orchestrator.config import DEFAULT_PORT as ORCHESTRATOR_PORT
    from orchestrator.server import SERVICE_NAME as ORCHESTRATOR_SERVICE
    from specdec.cli.main import build_parser
    from specdec.rpc.serving import ServerConfig
    from target_service.config import DEFAULT_PORT as TARGET_PORT
    from target_service.server import SERVICE_NAME as TARGET_SERVICE
    from tests.deploy_manifests import BOOLEAN_FLAGS, DEFAULT_DRAIN_GRACE_S, DEFAULT_PORTS, HEALTH_SERVICES, ROLE_FLAGS

    assert DEFAULT_PORTS == {"orchestrator": ORCHESTRATOR_PORT, "draft": DRAFT_PORT, "target": TARGET_PORT}
    assert HEALTH_SERVICES == {"orchestrator": ORCHESTRATOR_SERVICE, "draft": DRAFT_SERVICE, "target": TARGET_SERVICE}
    assert DEFAULT_DRAIN_GRACE_S == ServerConfig().drain_grace_s
    parser = build_parser()
    for role in ROLES:
        serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
        sub = next(a for a in serve._actions if isinstance(a, argparse._SubParsersAction)).choices[role]
        options = {o for a in sub._actions for o in a.option_strings}
        assert ROLE_FLAGS[role] <= options, f"not flags of `specd serve {role}`: {sorted(ROLE_FLAGS[role] - options)}"
        booleans = {o for a in sub._actions if isinstance(a, argparse.BooleanOptionalAction) for o in a.option_strings}
        assert BOOLEAN_FLAGS & options <= booleans


@pytest.mark.parametrize("render", RENDERS)
def test_the_orchestrator_service_names_the_http_ports_scheme(rendered, render):
    """Under --tls-cert the orchestrator's HTTP port serves HTTPS (orchestrator/openai_api/server.py):
    a Gateway or mesh reading the Service's appProtocol must not be told plaintext http."""
    from tests.deploy_manifests import _named, _serve_settings

    objects = rendered[render]
    tls = bool(_serve_settings(objects, "orchestrator").get("--tls-cert"))
    ports = {p["name"]: p for p in _named(objects, "Service", "specdec-orchestrator")["spec"]["ports"]}
    assert ports["http"].get("appProtocol") == ("https" if tls else "http"), f"{render}: {ports['http']}"
