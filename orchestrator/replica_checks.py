"""Whether the services the orchestrator connects to fit together.

A draft must draft in its target's token ids (`check_compatible`); target
replicas must read and write the same ids and be the same model, since a
request moves between them and every token must come from the target model's
own distribution (`check_same_ids`, `check_same_model`). Start-up checks every
replica it connected to (`check_replicas`); a replica that joins later, or
answers again after failing, must pass `admission` (the pool runs it:
orchestrator/replicas.py). A mismatch is FAILED_PRECONDITION naming both.
"""
from __future__ import annotations

import logging

from orchestrator.replicas import Replica, ReplicaPool
from orchestrator.speculation import LoopSettings
from specdec.errors import FailedPrecondition

log = logging.getLogger(__name__)


def usable_size_of(info) -> int:
    """The usable size a ModelInfo or EngineInfo announces
    (`specdec.engine.vocab.usable_size`); 0 in `usable_vocab_size` (a service
    older than the field, or the n-gram drafter) means all `vocab_size` ids."""
    return int(info.usable_vocab_size or info.vocab_size)


def check_compatible(draft_info, target_info) -> None:
    """The draft's token ids must mean the same as the target's (`check_same_ids`)."""
    if draft_info.backend == "ngram":
        if draft_info.vocab_size != target_info.vocab_size:
            raise FailedPrecondition(f"the ngram drafter's vocabulary ({draft_info.vocab_size}) differs from the target's ({target_info.vocab_size})")
        return
    check_same_ids(draft_info, target_info, ("draft", "target"))


def check_same_ids(a, b, roles: tuple[str, str]) -> None:
    """Two models' token ids must mean the same: a draft and its target, or
    two replicas of one service (a request moves between target replicas).

    Two models with tokenizers must share the tokenizer; their embedding rows
    may differ (Qwen2.5-0.5B pads to 151936 rows, the 7B to 152064), since each
    engine emits only the ids its tokenizer knows. Without a tokenizer, a model
    may name its family's ids (a synthetic Qwen2.5: `untokenized-qwen2.5-151665`),
    and two that name the same pair like tokenized ones; otherwise the ids are
    all there is, so the vocabulary sizes must be equal. `roles` names the
    two in the messages ("draft", "target").
    """
    names = f"{roles[0]} {a.model_name!r} and {roles[1]} {b.model_name!r}"
    fingerprints = (a.tokenizer_fingerprint, b.tokenizer_fingerprint)
    if all(fp and not fp.startswith("untokenized") for fp in fingerprints):
        if fingerprints[0] != fingerprints[1]:
            raise FailedPrecondition(f"{names} have different tokenizers: the two models must share a tokenizer")
    elif a.vocab_size != b.vocab_size and not (fingerprints[0] and len(set(fingerprints)) == 1):
        raise FailedPrecondition(
            f"{names}: {roles[0]} vocabulary size {a.vocab_size} != {roles[1]}'s {b.vocab_size}: "
            "the two models must share a tokenizer")
    if usable_size_of(a) != usable_size_of(b):
        raise FailedPrecondition(
            f"{names} read and emit different token ids ([0, {usable_size_of(a)}) and "
            f"[0, {usable_size_of(b)})): give both the same tokenizer, with an embedding row for each token"
        )


def replica_infos(pool: ReplicaPool | None) -> list[tuple[str, object]]:
    return [(r.address, r.client.info) for r in pool.replicas.values()] if pool else []


def check_replica_ids(info, reference, draft: bool, roles: tuple[str, str]) -> None:
    """A replica against the reference target: a draft must draft for it
    (`check_compatible`: its token ids, whatever its weights, since
    rejection sampling is exact for any draft); a target replica must read
    and write the same ids (`check_same_ids`) and be the same model
    (`check_same_model`), since a request moves between target replicas.
    `roles` names the two in a message. Start-up (`check_replicas`) and a
    replica joining later (`admission`) both check here."""
    if draft:
        check_compatible(info, reference)
    else:
        check_same_ids(info, reference, roles)
        check_same_model(info, reference, roles)


def check_same_model(a, b, roles: tuple[str, str]) -> None:
    """Two target replicas must compute one distribution: the same weights
    (`weights_fingerprint`, specdec/models/fingerprint.py), at the same
    dtype, in the same form (`weights`: int8 or not), ending generations on
    the same EOS ids. A request moves between target replicas when one
    fails, and its tokens must all come from one model: the output
    distribution is the target model's own, exactly. Where either replica
    reports no fingerprint (a service older than the field), only the
    model names can be compared, with a warning."""
    def differ(what: str, mine, theirs) -> FailedPrecondition:
        return FailedPrecondition(
            f"{roles[0]} ({a.model_name!r}) and {roles[1]} ({b.model_name!r}) are not the same model: "
            f"{what} {mine} != {theirs}. Every target replica must serve the same model (a request moves "
            "between them): give them all one checkpoint and settings, and to change the target model, "
            "roll every replica and restart the orchestrator")

    # The plainest difference first: other weights at another dtype differ in both.
    if a.dtype != b.dtype:
        raise differ("dtype", a.dtype, b.dtype)
    if a.weights != b.weights:
        raise differ("weights", repr(a.weights or "at dtype"), repr(b.weights or "at dtype"))
    if set(a.eos_token_ids) != set(b.eos_token_ids):
        raise differ("EOS token ids", sorted(set(a.eos_token_ids)), sorted(set(b.eos_token_ids)))
    if a.weights_fingerprint and b.weights_fingerprint:
        if a.weights_fingerprint != b.weights_fingerprint:
            raise differ("weights fingerprint", _short(a.weights_fingerprint), _short(b.weights_fingerprint))
        return
    if a.model_name != b.model_name:
        raise differ("model name", repr(a.model_name), repr(b.model_name))
    log.warning("%s and %s: %s reports no weights fingerprint (a service older than the field), so only "
                "their model names (%r) could be compared, not their weights", roles[0], roles[1],
                " and ".join(r for r, i in zip(roles, (a, b)) if not i.weights_fingerprint), a.model_name)


def _short(fingerprint: str) -> str:
    return fingerprint if len(fingerprint) <= 19 else fingerprint[:19] + "..."


def check_replicas(targets: ReplicaPool, drafts: ReplicaPool | None) -> None:
    """Every replica connected at start-up must fit the first target
    (`check_replica_ids`): target replicas read and write its token ids and
    are its model, and any draft replica drafts for any target replica."""
    first = targets.any()
    reference = first.client.info
    for address, info in replica_infos(targets):
        if address != first.address:
            check_replica_ids(info, reference, False, (f"target replica {address}", f"target replica {first.address}"))
    for _, info in replica_infos(drafts):
        check_replica_ids(info, reference, True, ("draft", "target"))


def admission(reference, settings: LoopSettings, draft: bool, reference_address: str = ""):
    """The check a replica that joins after start-up must pass (the pool
    refuses and closes it otherwise): what start-up checked
    (`check_replica_ids`; `reference_address` names the reference target in
    a message), and limits no smaller than those the orchestrator already
    uses (it accepts requests by them, and a request must fit on any
    replica)."""
    def admit(replica: Replica) -> None:
        info = replica.client.info
        check_replica_ids(info, reference, draft, (
            f"the new target replica {replica.address}",
            f"target replica {reference_address}" if reference_address else "the target"))
        if info.max_context < settings.max_context or info.max_draft_tokens < settings.max_draft_tokens:
            raise FailedPrecondition(
                f"its limits (max_context {info.max_context}, max_draft_tokens {info.max_draft_tokens}) are below "
                f"those the orchestrator uses ({settings.max_context}, {settings.max_draft_tokens}); "
                "restart the orchestrator to serve with smaller limits")
    return admit
