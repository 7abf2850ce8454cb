"""The model engine shared by the draft and target services.

A session is a token context plus a KV slot covering a prefix of it. Every
call that changes a session names (keep_length, tokens): cut the context to its
first keep_length tokens (an O(1) rollback), append the tokens, and run the
model over whatever the cache does not cover yet, returning the logits of the
last `num_logits` positions. Many sessions of different lengths run in ONE
forward pass: their new tokens are concatenated into one sequence, each token
carries its own position and slot, keys/values are written into the static
store in place, and attention reads each session's prefix where it lies
(kv_store.py, attention.py).

Not thread-safe: a service runs every engine call on one worker thread.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import PreTrainedModel

from specdec.engine import vocab
from specdec.engine.attention import STEP_KWARG, row_mask, use_store_attention
from specdec.engine.config import EngineConfig
from specdec.engine.draft_vocab import ranked_subset
from specdec.engine.kv_store import (
    KVStore,
    RowSpan,
    StepLayout,
    StoreCache,
    slots_for_budget,
)
from specdec.engine.loading import free_device_memory, load_model, tokenizer_fingerprint
from specdec.engine.fused_decoder import FusedDecoder
from specdec.engine.model_facts import (cache_kwarg, choose_kernel, context_limit, eos_ids, probe_kv_shape,
                                       wants_fused, wants_graphs)
from specdec.engine.packed_linear import wants_packing
from specdec.engine.quantize import choose_for as choose_quantize
from specdec.engine.prefill import PrefillJob
from specdec.engine.sessions import ContextRules, EngineSession, SessionTable, new_session_id
from specdec.engine.static_steps import CaptureReport, StaticSteps
from specdec.engine.weight_forms import WeightForms
from specdec.errors import InvalidArgument
from specdec.host_copy import to_device
from specdec.models.fingerprint import timed_fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtendItem:
    """One session's part of a batched forward pass."""

    session_id: str
    # Cut the context to this many tokens first (None: keep it whole).
    keep_length: int | None
    # Tokens appended after the cut.
    tokens: Sequence[int]
    # Return logits for the last num_logits positions of the new context
    # (0..len(context)); position i's logits predict token i + 1.
    num_logits: int


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    device: str
    dtype: str
    kv_bytes_per_token: int
    # Ids [0, usable_vocab_size) are read and emitted; the output rows beyond
    # are padding, masked to -inf (engine/vocab.py). 0: all vocab_size ids.
    usable_vocab_size: int = 0
    # "int8" once the linear layers run as int8 (quantize.py); "": at dtype.
    weights: str = ""
    # The weights' content fingerprint as loaded (specdec/models/fingerprint.py):
    # target replicas must agree on it.
    weights_fingerprint: str = ""


class ModelEngine(WeightForms):
    """Sessions, the KV store and batched forward passes over one causal LM
    (and, from WeightForms, what may be done to its weights once loaded)."""

    def __init__(self, model: PreTrainedModel, cfg: EngineConfig, tokenizer=None, name: str = "",
                 id_space: vocab.IdSpace | None = None):
        cfg.validate()
        self.cfg = cfg
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or cfg.model or type(model).__name__
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.usable_vocab_size = vocab.usable_size(self.vocab_size, tokenizer, id_space)
        self.max_context = context_limit(model.config, cfg.max_context)
        self.kv_shape = probe_kv_shape(self.model, self.device)
        # Before the weights change form (fused below; packed or int8 in `load`).
        fingerprint, took_s = timed_fingerprint(self.model)
        self.max_kv_bytes = cfg.max_kv_bytes or free_device_memory(self.device) // 2
        num_slots = slots_for_budget(self.kv_shape, self.max_context, self.max_kv_bytes, cfg.max_sessions)
        self.store = KVStore(self.kv_shape, num_slots, self.max_context)
        self.kernel = choose_kernel(cfg.attention, self.device)
        use_store_attention(self.model)
        # What a forward pass calls: the model through transformers, or its
        # layers as fused kernels (fused_decoder.py), from the same weights.
        self.fused = (FusedDecoder(self.model, use_triton=self.kernel == "triton")
                      if wants_fused(cfg.fused_layers, self.model) else None)
        self.forward_model = self.fused or self.model
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.steps: StaticSteps | None = None
        self.output_ids = self.vocab_size  # ids the output head computes (restrict_output)
        self.quantized = "none"  # quantize_weights
        self.capture_report: CaptureReport | None = None
        if wants_graphs(cfg.cuda_graphs, self.device, self.kernel, cfg.attention):
            self.use_static_steps(cfg.graph_max_tokens)
        self._sessions: SessionTable[EngineSession] = SessionTable(cfg.max_sessions)
        self.rules = ContextRules(self.usable_vocab_size, self.max_context)
        self.info = EngineInfo(
            model_name=self.name,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            eos_token_ids=eos_ids(self.model, self.vocab_size),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer, self.vocab_size, id_space),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            kv_bytes_per_token=self.kv_shape.bytes_per_token,
            usable_vocab_size=self.usable_vocab_size,
            weights_fingerprint=fingerprint,
        )
        log.info("%s: weights fingerprint %s (%.0f ms)", self.name, fingerprint, took_s * 1000)
        log.info("KV store: %d session slots of %d tokens, %.1f MiB; attention kernel %s; fused layers %s",
                 num_slots, self.max_context, self.store.nbytes / 2**20, self.kernel, "on" if self.fused else "off")

    @classmethod
    def load(cls, cfg: EngineConfig) -> "ModelEngine":
        loaded = load_model(cfg)
        engine = cls(loaded.model, cfg, tokenizer=loaded.tokenizer, name=loaded.name, id_space=loaded.id_space)
        if cfg.draft_vocab:
            engine.restrict_output(ranked_subset(cfg.model, engine.info, cfg.draft_vocab))
        kind, why = choose_quantize(cfg.quantize, engine.device.type, engine.model.config)
        if cfg.quantize == "auto":
            log.info("linear layers: %s (%s)", "int8" if kind == "int8" else "as loaded", why)
        if kind != "none":
            engine.quantize_weights(kind)
        if wants_packing(cfg.packed_linears, engine.device, engine.dtype):
            engine.pack_weights()
        return engine

    def use_static_steps(self, max_tokens: int) -> StaticSteps:
        """Run steps of up to max_tokens tokens at padded fixed shapes
        (captured as CUDA graphs by `warmup()` on CUDA)."""
        self.steps = StaticSteps(self.forward_model, self.store, max_tokens, self.kernel, self._keeps_logits)
        return self.steps

    def warmup(self) -> None:
        """Run the prefill, batched and single-token paths once, so the first
        real request does not pay for lazy initialization. Sized to fit any
        context limit the settings allow (2 tokens and up)."""
        prompt = min(8, self.max_context - 1)
        grow = min(4, self.max_context - prompt)  # the batched extend's new tokens
        opened = [self.open_session([0] * prompt)]
        try:
            if self.store.num_slots > 1:  # a batch of two, where two sessions fit
                opened.append(self.open_session([0] * min(3, prompt)))
            a = opened[0]
            items = [ExtendItem(a.id, None, [0] * grow, grow + 1)] + [ExtendItem(b.id, None, [0], 2)
                                                                     for b in opened[1:]]
            self.extend(items)
            self.extend([ExtendItem(a.id, prompt + grow - 2, [0], 1)])  # a rollback, then one token
        finally:
            for s in opened:
                self.close(s.id)
        if self.steps is not None and self.device.type == "cuda" and not self.steps.captured:
            self.capture_report = self.steps.capture()

    # -------------------------------------------------------------- sessions

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def slot_bytes(self) -> int:
        """KV bytes one session reserves (its slot)."""
        return self.store.bytes_per_slot

    @property
    def kv_bytes_reserved(self) -> int:
        """KV bytes held by open sessions; safe from any thread."""
        return len(self._sessions) * self.store.bytes_per_slot

    def session(self, session_id: str) -> EngineSession:
        return self._sessions.get(session_id)

    def open_session(self, prompt: Sequence[int], max_new_tokens: int = 0) -> EngineSession:
        """Create a session and prefill its prompt.

        The last prompt token is left out of the cache: the first extend needs
        its logits anyway, so it is computed there and not twice.
        """
        (session,) = self.open_sessions([(prompt, max_new_tokens)])
        if isinstance(session, Exception):
            raise session
        return session

    def open_sessions(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[EngineSession | Exception]:
        """Open a session for each (prompt, max_new_tokens) and prefill the
        prompts together, all passes now (`start_opening` for one pass at a
        time): each forward pass takes up to `prefill_chunk` prompt tokens,
        from as many sessions as they come from. Each request gets its
        session or its own error in its place (specdec/engine/prefill.py)."""
        return self.start_opening(requests).results()

    def start_opening(self, requests: Sequence[tuple[Sequence[int], int]]) -> PrefillJob:
        """The sessions of `requests` opened (each request's error in its
        place), their prompts left to compute one pass a `step()`."""
        return PrefillJob(self, requests)

    def reserve_session(self, prompt: list[int], max_new_tokens: int) -> EngineSession:
        """A new session holding `prompt` but its last token, none of it
        computed yet, marked as opening (the reaper leaves it alone): the
        first half of an open, for PrefillJob. Raises what the open would
        (the context rules, no room)."""
        self.rules.check_open(prompt, max_new_tokens)
        self._sessions.check_room()
        # The last prompt token is left to the first extend, which needs its logits anyway.
        return self._sessions.add(EngineSession(id=new_session_id(), tokens=prompt[:-1],
                                                slot=self.store.allocate(), opening=True))

    def compute_up_to(self, sessions: list[EngineSession], stops: list[int]) -> None:
        """One forward pass over tokens [cached, stop) of each session, no
        logits kept: a pass of prefill, for PrefillJob."""
        self._run(sessions, stops, [0] * len(sessions))

    def append_tokens(self, session_id: str, tokens: Sequence[int], computed: int = 0) -> int:
        """Append to the context without a forward pass (the next extend
        computes them); returns the new length. `computed`: the first so
        many are in the slot already (fed by `feed` before the host read them)."""
        session = self.session(session_id)
        self.rules.check_tokens(tokens, "appended tokens")
        self.rules.check_length(session, session.length + len(tokens))
        if computed:
            assert 0 < computed <= len(tokens) and session.cached == session.length, (computed, session.cached)
            session.cached += computed
        session.tokens.extend(int(t) for t in tokens)
        return session.length

    def feed(self, session_ids: Sequence[str], tokens: torch.Tensor) -> torch.Tensor:
        """One decode step in which session b's next token is tokens[b], a
        device tensor the host has not read (a chained draft step's pick):
        its keys/values go to the session's next position and its logits
        [B, V] come back, with no host sync. The contexts do not change: the
        caller appends each token once read, `append_tokens(..., computed=1)`.
        Each session must be computed up to its length (as after `extend`)."""
        sessions = [self.session(sid) for sid in session_ids]
        for session in sessions:
            assert session.cached == session.length, (session.cached, session.length)
            self.rules.check_length(session, session.length + 1)
        positions = [s.length for s in sessions]
        bases = [self.store.base(s.slot) for s in sessions]
        spans = [RowSpan(b, b + 1, base, p) for b, (p, base) in enumerate(zip(positions, bases))]
        return self._logits(tokens, positions, bases, spans, list(range(len(sessions))))

    def rollback(self, session_id: str, length: int) -> int:
        """Keep the first `length` tokens of the context: O(1)."""
        session = self.session(session_id)
        self.rules.check_rollback(session, length)
        del session.tokens[length:]
        session.cached = min(session.cached, length)
        return session.length

    def close(self, session_id: str) -> bool:
        """Free a session; False if it was already gone (closing twice is harmless)."""
        session = self._sessions.pop(session_id)
        if session is None:
            return False
        self.store.release(session.slot)
        return True

    def expire_idle(self, ttl_s: float) -> list[str]:
        """Close sessions unused for ttl_s seconds; returns their ids."""
        stale = [s.id for s in self._sessions.idle(ttl_s)]
        for sid in stale:
            self.close(sid)
        return stale

    # --------------------------------------------------------------- forward

    def extend(self, items: Sequence[ExtendItem]) -> list[torch.Tensor]:
        """Run one batched forward over several sessions.

        Returns, per item, logits of shape [num_logits, vocab] (model dtype).
        Every item is validated before any session changes, so a bad item
        leaves all sessions as they were.
        """
        sessions = self.validate(items)
        for item, session in zip(items, sessions):
            self._apply_cut_and_append(session, item)
        for item, session in zip(items, sessions):
            self._prefeed_long(session, item.num_logits)
        return self._forward(sessions, [item.num_logits for item in items])

    def validate(self, items: Sequence[ExtendItem]) -> list[EngineSession]:
        """Check a batch without changing anything; raises the first problem."""
        if not items:
            raise InvalidArgument("empty batch")
        ids = [item.session_id for item in items]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a session appears twice in one batch")
        sessions = [self.session(sid) for sid in ids]
        for item, session in zip(items, sessions):
            keep = session.length if item.keep_length is None else item.keep_length
            self.rules.check_keep(session, keep)
            self.rules.check_tokens(item.tokens, "appended tokens")
            new_length = keep + len(item.tokens)
            self.rules.check_length(session, new_length)
            if item.num_logits < 0:
                raise InvalidArgument(f"num_logits must be >= 0, got {item.num_logits}")
            if item.num_logits > new_length:
                # The first wanted position needs a token before it.
                raise InvalidArgument(
                    f"nothing precedes the positions asked for ({item.num_logits} logits from a context of "
                    f"{new_length} tokens): keep or append at least one token"
                )
        return sessions

    def _apply_cut_and_append(self, session: EngineSession, item: ExtendItem) -> None:
        keep = session.length if item.keep_length is None else item.keep_length
        del session.tokens[keep:]
        session.tokens.extend(int(t) for t in item.tokens)
        # The positions whose logits are wanted must be recomputed.
        session.cached = min(session.cached, keep, session.length - item.num_logits)

    def _prefeed_long(self, session: EngineSession, num_logits: int) -> None:
        """Feed, alone and in chunks, the part of a long pending run whose
        logits are not wanted, so a batched step stays small."""
        chunk = self.cfg.prefill_chunk
        while session.length - session.cached > max(chunk, num_logits):
            stop = min(session.cached + chunk, session.length - max(num_logits, 1))
            self._run([session], [stop], [0])

    def _forward(self, sessions: list[EngineSession], num_logits: list[int]) -> list[torch.Tensor]:
        return self._run(sessions, [s.length for s in sessions], num_logits)

    def _run(self, sessions: list[EngineSession], stops: list[int], num_logits: list[int]) -> list[torch.Tensor]:
        """One forward pass over tokens [cached, stop) of each session;
        returns, per session, the logits of its last num_logits new tokens."""
        tokens, positions, bases, spans = [], [], [], []
        for session, stop in zip(sessions, stops):
            start = session.cached
            base = self.store.base(session.slot)
            spans.append(RowSpan(len(tokens), len(tokens) + stop - start, base, start))
            tokens.extend(session.tokens[start:stop])
            positions.extend(range(start, stop))
            bases.extend([base] * (stop - start))
        if not tokens:
            return [torch.empty((0, self.vocab_size), dtype=self.dtype, device=self.device) for _ in sessions]
        wanted = [i for row, n in zip(spans, num_logits) for i in range(row.stop - n, row.stop)]
        logits = self._logits(tokens, positions, bases, spans, wanted)
        for session, row in zip(sessions, spans):
            session.cached = row.end
        return list(torch.split(logits, num_logits))

    def _logits(self, tokens: list[int] | torch.Tensor, positions: list[int], bases: list[int],
                spans: list[RowSpan], wanted: list[int]) -> torch.Tensor:
        """The `wanted` rows' logits of one forward over `tokens` (a fixed-shape
        step where one fits, else eagerly), padded vocabulary rows masked."""
        if self.steps is not None and self.steps.fits(len(tokens)):
            every = self.steps.run(tokens, positions, bases)  # [len(tokens), V], a copy
            # wanted is ascending: as long as the step means every row (a decode,
            # a verify), in order.
            logits = every if len(wanted) == len(tokens) else every[to_device(wanted, self.device)]
        else:
            logits = self._call_model(tokens, self._eager_layout(spans, positions, bases), wanted)
        vocab.mask_padding_(logits, self.usable_vocab_size)  # padded rows are never sampled
        return logits

    def _eager_layout(self, spans: list[RowSpan], positions: list[int], bases: list[int]) -> StepLayout:
        for row in spans:
            row.mask = row_mask(row.stop - row.start, row.first_position, self.device)
        position, key_base = to_device([positions, bases], self.device)
        return StepLayout(rows=spans, write_index=key_base + position, key_base=key_base, position=position,
                          kernel=self.kernel)

    def _call_model(self, tokens: list[int] | torch.Tensor, layout: StepLayout, wanted: list[int]) -> torch.Tensor:
        kwargs = {}
        if self._keeps_logits:
            # Only the wanted rows go through the LM head (at least one:
            # transformers reads an empty selection as "all").
            kwargs["logits_to_keep"] = to_device(wanted or [len(tokens) - 1], self.device)
        with torch.inference_mode():
            out = self.forward_model(
                input_ids=tokens[None] if isinstance(tokens, torch.Tensor) else to_device([tokens], self.device),
                position_ids=layout.position.unsqueeze(0),
                use_cache=True,
                **{cache_kwarg(self.forward_model): StoreCache(self.store, layout), STEP_KWARG: layout},
                **kwargs,
            )
        logits = out.logits[0]
        if not wanted:
            return logits[:0]
        return logits if self._keeps_logits else logits[to_device(wanted, self.device)]

