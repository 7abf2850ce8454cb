"""Shared fixtures: tiny models built from configs (random weights, no download)."""
from __future__ import annotations

import pytest

from specdec import heap

# As `specd serve` imports a role (specdec/heap.py): the heavy imports without
# the collector's full walks, and what they made frozen out of later ones.
with heap.importing():
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    from specdec.engine.config import EngineConfig
    from specdec.engine.engine import ModelEngine
    # The deployment tests' fixtures, registered here so that deploy/validate.sh renders the
    # manifests once a session rather than once in each tests/test_deploy_*.py.
    from tests.deploy_manifests import rendered, validation  # noqa: F401 - pytest fixtures, used by name

# The test files that take a minute or more of one worker, longest first
# (seconds per file from `pytest -n auto --dist loadfile --junitxml=...` on the
# 2-core dev VM, 2026-11-27: real models 273 when their weights are cached,
# faults 192, orchestrator 179, pipelining 150, bench 147, models 92, soak 90,
# rejection exactness 83, fused decoder 64). pytest-xdist's loadfile hands
# files out in collection order; alphabetical order left the soak and the
# rejection tests to start last, and one worker ran on alone for a minute or
# more after the other had finished. (xdist's own order, by each file's number
# of tests, put the fault runs and the soak last: pyproject's addopts turn it
# off.) Only the order changes, never a result.
HEAVY_FIRST = ("test_real_models.py", "test_faults_under_load.py", "test_orchestrator.py", "test_pipelining.py",
               "test_bench.py", "test_models.py", "test_soak.py", "test_rejection_exactness.py",
               "test_fused_decoder.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: the rest keep their order


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU and half as many again (at most 4 more).

    Much of the suite waits rather than computes: child services importing
    torch one after another, a soak's clients between requests, a drain. With
    one worker per CPU the 2-core dev VM sat 27% idle over a whole run
    (/proc/stat, 2026-11-28) and took 823 s; with three workers it was 2% idle
    and took 711 s, every test passing. PYTEST_XDIST_AUTO_NUM_WORKERS still
    decides when set (pytest-xdist's own hook reads it)."""
    import os

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus + min(4, max(1, cpus // 2))

TINY_VOCAB = 128

# In-process services run forward passes on several threads at once (each
# engine's worker, the test's own references); with torch's default of one
# intra-op thread per core, their OpenMP teams oversubscribe a small shared
# machine: on the 2-core CI machine, loaded, one concurrency test took 123 s
# instead of 9 s. Tiny tensors gain nothing from more threads, so every test
# runs with one; `_one_intra_op_thread` puts it back after a test that loads
# an engine with `threads` set (services started as child processes get
# their own --threads).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def tiny_config(arch: str, vocab_size: int = TINY_VOCAB, layers: int = 2, init_range: float = 0.02):
    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           initializer_range=init_range, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           initializer_range=init_range, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=1024,
                          initializer_range=init_range, **common)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, **kwargs):
    """A small random causal LM. init_range > 0.02 gives peaked (tie-free)
    distributions, which greedy-equality tests want."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs), dtype=torch.float32,
                                             attn_implementation="sdpa")
    return model.eval()


def tiny_engine(arch: str = "llama", seed: int = 0, model=None, **cfg) -> ModelEngine:
    cfg.setdefault("dtype", "float32")
    model = model if model is not None else tiny_model(arch, seed)
    return ModelEngine(model, EngineConfig(**cfg), name=f"tiny-{arch}-{seed}")


@pytest.fixture(params=["llama", "qwen2", "gpt2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """Run a module with one intra-op thread: on tiny tensors more threads only
    add contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
