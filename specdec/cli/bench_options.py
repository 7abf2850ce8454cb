"""`specd bench`'s settings: flags resolved into one checked dict, and the
prompts every system is sent.

`resolve` fills in the --quick or full defaults, checks every flag and names
the configs to run; `build_prompts` turns the prompt flags into token ids. A
mistake of the user's raises `UsageError` (one line, exit code 2).
"""
from __future__ import annotations

import argparse
import math

from specdec.bench.runner import BASELINES, HF_ASSISTED, HF_KINDS, HF_STATIC, SERVICE
from specdec.cli.flag_types import INT32_MAX, UINT64_MAX
from specdec.errors import InvalidArgument
from specdec.limits import check_num_draft_tokens
from specdec.models.catalog import DEFAULT_PAIR

QUICK = dict(prompts=1, chat_prompts=1, token_prompts=2, max_tokens=16, num_draft_tokens=[4],
             policies=["fixed", "adaptive", "goodput", "goodput-pipeline"], temperatures=[0.0, 0.7],
             concurrency=[1, 4], repeats=1)
FULL = dict(prompts=10, chat_prompts=4, token_prompts=10, max_tokens=128, num_draft_tokens=[2, 3, 4, 5, 6],
            policies=["fixed", "adaptive", "goodput", "goodput-pipeline"], temperatures=[0.0, 0.7],
            concurrency=[1, 4, 8], repeats=3)


class UsageError(Exception):
    """A mistake of the user's: one line, exit code 2."""


def _pick(args, name: str):
    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else FULL)[name]


def resolve(args: argparse.Namespace) -> dict:
    """Every setting, defaults filled in and checked; raises UsageError."""
    o = {name: _pick(args, name) for name in FULL}
    o["notes"] = []  # settings the bench changed on its own: printed before it starts, and in summary.md
    o["baselines"] = _default_baselines(args) if args.baselines is None else list(args.baselines)
    o["policies"] = [] if o["policies"] == ["none"] else list(o["policies"])
    o["token_prompt_len"] = args.token_prompt_len
    for name in ("max_tokens", "repeats", "token_prompt_len"):
        if o[name] < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    try:
        for k in o["num_draft_tokens"]:
            check_num_draft_tokens(k)  # the services' default limit
    except InvalidArgument as exc:
        raise UsageError(f"--num-draft-tokens: {exc}") from None
    if any(c < 1 for c in o["concurrency"]):
        raise UsageError("--concurrency values must be at least 1")
    if any(t < 0 for t in o["temperatures"]):
        raise UsageError("--temperatures must be >= 0")
    if args.threads < 0:
        raise UsageError("--threads must be >= 0")
    if args.rtt_ms and (args.draft_rtt_ms is not None or args.target_rtt_ms is not None):
        raise UsageError("use either --rtt-ms (a sweep, both services) or --draft-rtt-ms/--target-rtt-ms")
    if any(x < 0 for x in (args.rtt_ms or []) + [v for v in (args.draft_rtt_ms, args.target_rtt_ms) if v is not None]) \
            or args.jitter_ms < 0:
        raise UsageError("round-trip times and jitter must be >= 0")
    for name in ("device", "draft_device", "target_device"):
        dev = getattr(args, name)
        if dev is not None and not (dev == "cpu" or dev == "cuda" or dev.startswith("cuda:")):
            raise UsageError(f"--{name.replace('_', '-')} must be cpu, cuda or cuda:N, not {dev!r}")
    o["draft_device"] = args.draft_device or args.device
    o["target_device"] = args.target_device or args.device
    o["draft_quantize_setting"] = getattr(args, "draft_quantize", "none")
    if o["draft_quantize_setting"] == "int8" and o["draft_device"] != "cpu":
        raise UsageError("--draft-quantize int8 runs on the CPU only: use --draft-device cpu")
    if any(d.startswith("cuda") for d in (o["draft_device"], o["target_device"])):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("a cuda device was asked for, but torch sees no CUDA device here")

    # models and prompts
    if args.pair in SYNTH_PAIRS:
        if args.draft or args.target:
            raise UsageError(f"--pair {args.pair} picks its own models: drop --draft/--target")
        draft, target = SYNTH_PAIRS[args.pair]
        o["draft"] = o["draft_dir"] = f"synth:{draft}"
        o["target"] = o["target_dir"] = f"synth:{target}"
        o["token_mode"] = not (args.prompts or args.chat_prompts)  # random weights: token ids unless asked
        if o["token_mode"] and o["token_prompts"] is None:
            o["token_prompts"] = 2 if args.quick else 4
    elif args.pair == "tiny":
        if args.draft or args.target:
            raise UsageError("--pair tiny picks its own models: drop --draft/--target")
        if args.prompts or args.chat_prompts:
            raise UsageError("--pair tiny has no tokenizer: use --token-prompts N, not --prompts/--chat-prompts")
        o["token_mode"] = True
    if args.pair not in SYNTH_PAIRS and args.pair != "tiny":
        o["draft"] = args.draft or DEFAULT_PAIR.draft
        o["target"] = args.target or DEFAULT_PAIR.target
        o["draft_dir"] = _resolve_model(o["draft"])
        o["target_dir"] = _resolve_model(o["target"])
        o["token_mode"] = args.token_prompts is not None
        if o["token_mode"] and (args.prompts or args.chat_prompts):
            raise UsageError("--token-prompts replaces the text prompts: drop --prompts/--chat-prompts")
    if o["token_mode"]:
        o["prompts"], o["chat_prompts"] = 0, 0
        if o["token_prompts"] < 1:
            raise UsageError("--token-prompts must be at least 1")
    else:
        o["token_prompts"] = 0
        if o["prompts"] < 0 or o["chat_prompts"] < 0 or o["prompts"] + o["chat_prompts"] < 1:
            raise UsageError("give at least one prompt (--prompts N and/or --chat-prompts N)")
        from specdec.bench.prompts import CHAT_PROMPTS

        if o["chat_prompts"] > len(CHAT_PROMPTS):
            raise UsageError(f"--chat-prompts: there are {len(CHAT_PROMPTS)} chat prompts")
    _check_request_values(args, o)

    from specdec.bench.configs import with_confidences
    from specdec.bench.runner import build_configs, network_conditions, with_variants

    o["draft_vocabs"], o["batching"] = _draft_heads(args), _batcher_settings(args)
    o["gates"] = _on_off(args.speculation_gate, "--speculation-gate")
    try:
        o["configs"] = with_confidences(
            with_variants(build_configs(o["baselines"], o["num_draft_tokens"], o["policies"]),
                          o["draft_vocabs"], o["batching"], o["gates"]),
            args.draft_min_confidence)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not o["configs"]:
        raise UsageError("nothing to run: give --baselines and/or --policies")
    if any(b in o["baselines"] for b in HF_KINDS) and 1 not in o["concurrency"]:
        raise UsageError("the HF baselines run at concurrency 1: include 1 in --concurrency or drop them")
    if HF_ASSISTED in o["baselines"]:
        rows = _vocab_rows(o["draft_dir"]), _vocab_rows(o["target_dir"])
        if None not in rows and rows[0] != rows[1]:  # bench/hf_baselines.py matches them
            o["notes"].append(f"hf-assisted: the draft's {rows[0]} vocabulary rows were matched to the target's "
                              f"{rows[1]} for transformers' assisted generation, which takes differing rows for "
                              "differing tokenizers; the draft proposes what it would (no id past its own rows, "
                              "none past the target's)")
    o["concurrency_configs"] = args.concurrency_configs
    if args.concurrency_configs:
        unknown = set(args.concurrency_configs) - {n for c in o["configs"] if c.kind == SERVICE for n in (c.name, c.base)}
        if unknown:
            raise UsageError(f"--concurrency-configs: no service config named {', '.join(sorted(unknown))}")
    elif args.quick:  # target-only and one specdec config: the newest policy asked for, else the first
        spec = [c.base for c in o["configs"] if c.speculative]
        o["concurrency_configs"] = ["target-only"] + ([spec[-1]] if spec else [])
    if len(o["draft_vocabs"]) > 1 and not any(c.speculative for c in o["configs"]):
        raise UsageError("several --draft-vocab sizes compare specdec configs: add --policies")
    if len(o["batching"]) > 1 and max(o["concurrency"]) < 2:
        raise UsageError("--batcher on off compares the batcher under concurrency: add a --concurrency value above 1")
    if len(o["gates"]) > 1 and max(o["concurrency"]) < 2:
        raise UsageError("--speculation-gate on off compares the gate under concurrency: add a --concurrency value "
                         "above 1")
    o["conditions"] = network_conditions(args.rtt_ms, args.draft_rtt_ms, args.target_rtt_ms, args.jitter_ms)
    o["uses_services"] = any(c.kind == SERVICE for c in o["configs"])
    if any(c.proxied for c in o["conditions"]):
        if not o["uses_services"]:
            raise UsageError("network conditions apply to the services: add service configs")
        try:
            import specdec.latency_proxy  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"network conditions need specdec.latency_proxy, which cannot be imported: {exc}") from None
    if "draft_dir" in o:  # the tiny pair's models are made later, and are tiny
        _choose_draft_weights(o)
        _check_memory(getattr(args, "dtype", "auto"), o["draft_quantize"], o)
    return o


def _check_request_values(args, o: dict) -> None:
    """What every request carries must fit its field on the wire (int32
    max_tokens, uint64 seed) and mean something: checked here, or protobuf
    refuses it once the services have loaded ("Value out of range")."""
    if o["max_tokens"] > INT32_MAX:
        raise UsageError(f"--max-tokens must be in [1, {INT32_MAX}], got {o['max_tokens']}")
    if not all(math.isfinite(t) for t in o["temperatures"]):
        raise UsageError("--temperatures must be finite numbers >= 0")
    prompts = o["token_prompts"] if o["token_mode"] else o["prompts"] + o["chat_prompts"]
    highest = UINT64_MAX - (prompts - 1)  # prompt i is sent seed + i
    seed = getattr(args, "seed", 0)
    if not 0 <= seed <= highest:
        raise UsageError(f"--seed must be in [0, {highest}] (prompt i is sent seed + i), got {seed}")


def _choose_draft_weights(o: dict) -> None:
    """--draft-quantize as the draft service would resolve it for this draft
    (engine/quantize.py): the services and HF assisted get the outcome, so
    both speculate with the same draft, and the summary names it."""
    from specdec.engine.quantize import choose_for
    from specdec.models.cache import ModelNotFoundError
    from specdec.models.skeleton import model_config

    try:
        config = model_config(o["draft_dir"])
    except ModelNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if config is None and o["draft_quantize_setting"] == "auto":
        # No config to read here (a .gguf, say): the draft service and HF
        # assisted each choose from the model they load, by the same rule.
        o["draft_quantize"], o["draft_quantize_why"] = "auto", "auto: chosen as each loads the draft"
        return
    o["draft_quantize"], o["draft_quantize_why"] = choose_for(o["draft_quantize_setting"], o["draft_device"], config)


def _check_memory(dtype: str, quantize: str, o: dict) -> None:
    """Refuse a run whose weights cannot fit before anything loads (bench/memory_fit.py):
    each model in its own device's dtype, one draft per --draft-vocab head, an int8 draft at int8."""
    import torch

    from specdec.bench import memory_fit
    from specdec.engine.loading import free_device_memory

    hf = [b for b in o["baselines"] if b in HF_KINDS]
    draft = memory_fit.Placement(o["draft_dir"], o["draft_device"], memory_fit.element_bytes(dtype, o["draft_device"]),
                                 heads=tuple(o["draft_vocabs"]), int8=quantize == "int8")
    target = memory_fit.Placement(o["target_dir"], o["target_device"],
                                  memory_fit.element_bytes(dtype, o["target_device"]))
    run = memory_fit.loads(draft, target, services=o["uses_services"], hf_target=bool(hf), hf_draft=HF_ASSISTED in hf)
    reason = memory_fit.overcommitted(run, lambda device: free_device_memory(torch.device(device)))
    if reason:
        raise UsageError(f"{reason}: pick a smaller pair or another --device, or drop the HF baselines")


def _draft_heads(args) -> list[int]:
    """--draft-vocab: one draft service per size (0: the full head)."""
    heads = list(args.draft_vocab)
    if any(v < 0 for v in heads):
        raise UsageError("--draft-vocab sizes must be >= 0 (0: the full head)")
    if len(set(heads)) != len(heads):
        raise UsageError("--draft-vocab: a size is listed twice")
    return heads


def _batcher_settings(args) -> list[bool]:
    """--batcher on/off: the orchestrator's verify batcher; both: the service
    configs also run at concurrency > 1 with it off."""
    return _on_off(args.batcher, "--batcher")


def _on_off(values: list[str], flag: str) -> list[bool]:
    """An on/off flag that may take both (compare the two)."""
    if len(set(values)) != len(values):
        raise UsageError(f"{flag}: a setting is listed twice")
    return [v == "on" for v in values]


# Random-weight pairs of real architectures (specdec/models/synth.py), built
# in place by the services: real step and round costs, no real acceptance.
SYNTH_PAIRS = {
    "synth-tiny": ("tiny", "tiny"),
    "synth-0.5b-1.5b": ("qwen2.5-0.5b", "qwen2.5-1.5b"),
    "synth-0.5b-7b": ("qwen2.5-0.5b", "qwen2.5-7b"),
    "synth-0.5b-14b": ("qwen2.5-0.5b", "qwen2.5-14b"),
    "synth-0.5b-32b": ("qwen2.5-0.5b", "qwen2.5-32b"),
}


def _default_baselines(args) -> list[str]:
    """Every baseline; the static-cache HF one only on CUDA, where it is
    compiled (on a CPU it is uncompiled and adds little but time)."""
    cuda = any((d or "").startswith("cuda") for d in (args.device, args.draft_device, args.target_device))
    return [b for b in BASELINES if b != HF_STATIC or cuda]


def _resolve_model(name: str) -> str:
    """A model directory; a catalog model not fetched yet is fetched first, as
    `specd up` does, so `specd bench` works on a fresh machine. A synth:NAME
    stays a name: the services build it."""
    from specdec.models.cache import ModelNotFoundError, resolve_model
    from specdec.models.catalog import CATALOG
    from specdec.models.synth import is_synth_name

    if is_synth_name(name):
        return name

    try:
        return str(resolve_model(name))
    except ModelNotFoundError as exc:
        if name not in CATALOG:
            raise UsageError(f"{exc} (`specd models list` shows the catalog)") from None
    from specdec.models.fetch import fetch

    fetch(name)
    return str(resolve_model(name))


def use_tiny_pair(o: dict) -> None:
    """Make (once) the tiny random pair and point the settings at it."""
    try:
        from specdec.bench.tiny_pair import ensure_tiny_pair
    except ImportError as exc:
        raise UsageError(f"--pair tiny needs specdec.bench.tiny_pair, which cannot be imported: {exc}") from None
    draft_dir, target_dir = ensure_tiny_pair()
    o["draft"] = o["draft_dir"] = str(draft_dir)
    o["target"] = o["target_dir"] = str(target_dir)
    _choose_draft_weights(o)


def build_prompts(o: dict, pair: str, seed: int) -> list:
    """Prompt token ids, the same for every system."""
    from specdec.bench.runner import Prompt

    if o["token_mode"]:
        if pair == "tiny":
            from specdec.bench.tiny_pair import tiny_prompts

            ids = tiny_prompts(o["token_prompts"])
        else:
            ids = _random_token_prompts(o["target_dir"], o["token_prompts"], o["token_prompt_len"], seed)
        return [Prompt(i, "token-ids", tuple(int(t) for t in p), seed + i, f"{len(p)} random tokens")
                for i, p in enumerate(ids)]
    tok = _tokenizer(o["target_dir"])
    prompts = []
    if o["prompts"]:
        from specdec.bench.prompts import humaneval_prompts

        for text in humaneval_prompts(o["prompts"]):
            ids = list(tok(text, add_special_tokens=True)["input_ids"])  # as the orchestrator tokenizes text
            prompts.append(("humaneval", ids, text.strip().splitlines()[0][:60]))
    if o["chat_prompts"]:
        from specdec.bench.prompts import chat_prompts

        if not getattr(tok, "chat_template", None):
            raise UsageError("the target's tokenizer has no chat template: use --chat-prompts 0")
        for messages in chat_prompts(o["chat_prompts"]):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            prompts.append(("chat", list(ids), messages[0]["content"][:60]))
    return [Prompt(i, kind, tuple(int(t) for t in ids), seed + i, label) for i, (kind, ids, label) in enumerate(prompts)]


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise UsageError(f"the target {model_dir} has no tokenizer ({exc.__class__.__name__}): "
                         "use --token-prompts N") from None


def _random_token_prompts(model_dir: str, n: int, length: int, seed: int) -> list[list[int]]:
    import random

    from specdec.models.skeleton import model_config
    from specdec.models.synth import id_space, is_synth_name

    config = model_config(model_dir)
    if config is None:
        raise UsageError(f"--token-prompts: no config for {model_dir}")
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    special = {t for t in [*eos, config.bos_token_id, getattr(config, "pad_token_id", None)] if t is not None}
    rng = random.Random(seed)
    from specdec.engine.vocab import usable_size_of_directory

    if is_synth_name(model_dir):  # its tokenizer, if any, is its family's: ids below that family's size
        space = id_space(model_dir)
        vocab = min(int(config.vocab_size), space.size) if space else int(config.vocab_size)
    else:
        vocab = usable_size_of_directory(model_dir, int(config.vocab_size))  # padded rows are refused as input
    out = []
    for _ in range(n):
        prompt = []
        while len(prompt) < length:
            t = rng.randrange(3, vocab)
            if t not in special:
                prompt.append(t)
        out.append(prompt)
    return out


def _vocab_rows(model: str | None) -> int | None:
    """The embedding rows of a synth:NAME model or a model directory (None: not known here)."""
    from specdec.models.skeleton import model_config

    config = model_config(model) if model else None
    return getattr(config, "vocab_size", None)
