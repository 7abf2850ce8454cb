"""The container image (Dockerfile, .dockerignore): a numeric non-root user, pinned base images,
no model baked in, `specd` as the entrypoint, and a build context holding the sources and nothing else.
Shared constants: tests/deploy_manifests.py.
"""
from __future__ import annotations

import os
import re

from tests.deploy_manifests import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PORTS,
    LANE_PORTS,
    MODEL_CACHE,
    MODEL_FILE,
    ROOT,
)


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


def test_the_gpu_image_has_the_c_compiler_triton_builds_its_launchers_with():
    """Triton compiles a launcher per kernel at its first launch; a slim base has no compiler,
    so the final stage installs one, for every torch variant but the CPU one."""
    final = _final_stage(_dockerfile_instructions())
    assert ("ARG", "TORCH_VARIANT=cuda") in final, "the final stage must know the torch variant"
    runs = [rest for keyword, rest in final if keyword == "RUN" and "gcc" in rest]
    assert len(runs) == 1, "one RUN installs the compiler"
    assert '"${TORCH_VARIANT}" != cpu' in runs[0] and "apt-get install" in runs[0] and "libc6-dev" in runs[0]
    assert "rm -rf /var/lib/apt/lists/*" in runs[0]  # no apt lists left in the layer


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
