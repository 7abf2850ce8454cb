"""The configs `specd bench` runs: ways of decoding, and for the service
configs the route they take (which draft head, verify batcher on or off,
speculation gate on or off).

A *config* is one way of decoding (target-only through the services, plain
HF generate, HF assisted generation, specdec with a policy). `build_configs`
names them from the flags; `with_variants` multiplies the speculative ones by
draft head and speculation gate setting and the service ones by batcher
setting, `with_confidences` the speculative ones by the draft's stopping
threshold (a per-request option); `routes` lists the
orchestrators those need (the bench starts one per route, see services.py).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from specdec.limits import check_min_confidence

SERVICE, HF, HF_STATIC, HF_ASSISTED = "service", "hf", "hf-static", "hf-assisted"
BASELINES = (SERVICE, HF, HF_STATIC, HF_ASSISTED)
HF_KINDS = (HF, HF_STATIC, HF_ASSISTED)  # the baselines run by transformers in the bench's own process
TARGET_ONLY = "target-only"
PIPELINE_SUFFIX = "-pipeline"


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One way of decoding. policy "none" is target-only through the services."""

    name: str
    kind: str
    policy: str = ""
    k: int | None = None
    pipeline: bool = False
    # Service configs: the draft head (0: full), the orchestrator's verify
    # batcher and speculation gate they run against (a `Route`); waves_only:
    # not at concurrency 1.
    draft_vocab: int = 0
    batching: bool = True
    gate: bool = True
    waves_only: bool = False
    # Speculative configs: the request's draft_min_confidence; None: the server's default.
    min_confidence: float | None = None

    @property
    def speculative(self) -> bool:
        return self.kind == SERVICE and self.policy != "none"

    @property
    def route(self) -> "Route":
        return Route(self.draft_vocab, self.batching, self.gate)

    @property
    def base(self) -> str:
        """The name without the head, batcher and gate suffixes."""
        return self.name.split("/", 1)[0]

    def request_kwargs(self) -> dict:
        """Keyword arguments for `Client.generate` (service configs)."""
        if self.policy == "none":
            return {"speculate": False}
        kwargs = {"policy": self.policy, "pipeline": self.pipeline}
        if self.k:
            kwargs["num_draft_tokens"] = self.k
        if self.min_confidence is not None:
            kwargs["draft_min_confidence"] = self.min_confidence
        return kwargs

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def build_configs(baselines: Sequence[str], ks: Sequence[int], policies: Sequence[str]) -> list[BenchConfig]:
    """The configs to run. Policies are names the orchestrator knows
    ("fixed" expands to one config per k); a "-pipeline" suffix asks for
    pipelined drafting (e.g. "goodput-pipeline"). Other policies start from
    the server's default k."""
    configs: list[BenchConfig] = []
    if SERVICE in baselines:
        configs.append(BenchConfig(TARGET_ONLY, SERVICE, "none"))
    if HF in baselines:
        configs.append(BenchConfig("hf", HF))
    if HF_STATIC in baselines:
        configs.append(BenchConfig("hf-static", HF_STATIC))
    if HF_ASSISTED in baselines:
        configs.append(BenchConfig("hf-assisted", HF_ASSISTED))
    for spec in policies:
        pipeline = spec.endswith(PIPELINE_SUFFIX)
        policy = spec[: -len(PIPELINE_SUFFIX)] if pipeline else spec
        suffix = PIPELINE_SUFFIX if pipeline else ""
        if policy == "fixed":
            configs += [BenchConfig(f"fixed-k{k}{suffix}", SERVICE, "fixed", k, pipeline) for k in ks]
        else:
            configs.append(BenchConfig(spec, SERVICE, policy, None, pipeline))
    names = [c.name for c in configs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"configs listed twice: {', '.join(duplicates)}")
    return configs


@dataclasses.dataclass(frozen=True)
class Route:
    """Which orchestrator a service config talks to: the one whose draft
    service has this head (0: full), with its verify batcher and its
    speculation gate on or off."""

    draft_vocab: int = 0
    batching: bool = True
    gate: bool = True

    @property
    def name(self) -> str:
        return ((f"v{self.draft_vocab}" if self.draft_vocab else "full") + ("" if self.batching else "-nobatch")
                + ("" if self.gate else "-nogate"))


def with_variants(configs: Sequence[BenchConfig], draft_vocabs: Sequence[int],
                  batching: Sequence[bool], gates: Sequence[bool] = (True,)) -> list[BenchConfig]:
    """Each speculative config once per draft head, each service config also
    with the verify batcher off when both settings are asked for, and each
    speculative one also with the speculation gate off when both are.

    With one head, one batcher and one gate setting, nothing changes but the
    route fields (single-size runs keep today's names). Otherwise a config on
    a trimmed head is named NAME/vN (NAME alone: the full head, 0), one with
    the batcher off NAME/batcher-off, and one with the gate off NAME/gate-off;
    the last two run only at concurrency > 1 (the batcher and the gate only
    matter there). Target-only uses no draft: it runs once per batcher
    setting, against the first head's orchestrator with the first gate setting."""
    if not draft_vocabs or not batching or not gates:
        raise ValueError("give at least one draft head, one batcher and one gate setting")
    for what, values in (("--draft-vocab", draft_vocabs), ("--batcher", batching), ("--speculation-gate", gates)):
        if len(set(values)) != len(values):
            raise ValueError(f"{what}: a value is listed twice")
    several_heads, both, both_gates = len(draft_vocabs) > 1, len(batching) > 1, len(gates) > 1
    out: list[BenchConfig] = []
    for cfg in configs:
        if cfg.kind != SERVICE:
            out.append(cfg)
            continue
        for vocab in draft_vocabs if cfg.speculative else draft_vocabs[:1]:
            for on in sorted(batching, reverse=True):  # on first
                for gate in sorted(gates, reverse=True) if cfg.speculative else gates[:1]:
                    name = cfg.name + (f"/v{vocab}" if several_heads and vocab and cfg.speculative else "")
                    off_variant = both and not on
                    gate_off = both_gates and not gate
                    name += ("/batcher-off" if off_variant else "") + ("/gate-off" if gate_off else "")
                    out.append(dataclasses.replace(cfg, name=name, draft_vocab=vocab, batching=on, gate=gate,
                                                   waves_only=off_variant or gate_off))
    return out


def with_confidences(configs: Sequence[BenchConfig], values: Sequence[float]) -> list[BenchConfig]:
    """Each speculative config once per draft_min_confidence in `values`
    (no values: the server's default). With one value nothing is renamed;
    with several, a config is named NAME/cP (e.g. goodput/c0.5)."""
    if len(set(values)) != len(values):
        raise ValueError("--draft-min-confidence: a value is listed twice")
    for value in values:
        check_min_confidence(value, "--draft-min-confidence")
    if not values:
        return list(configs)
    out: list[BenchConfig] = []
    for cfg in configs:
        if not cfg.speculative:
            out.append(cfg)
            continue
        for value in values:
            name = cfg.name + (f"/c{value:g}" if len(values) > 1 else "")
            out.append(dataclasses.replace(cfg, name=name, min_confidence=value))
    return out


def routes(configs: Sequence[BenchConfig]) -> list[Route]:
    """The orchestrators the service configs need, in first-use order."""
    return list(dict.fromkeys(c.route for c in configs if c.kind == SERVICE))
