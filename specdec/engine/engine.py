"""The model engine shared by the draft and target services.

A session is a token context plus a KV cache covering a prefix of it. Every
call that changes a session names (keep_length, tokens): cut the context to its
first keep_length tokens (an O(1) rollback), append the tokens, and run the
model over whatever the cache does not cover yet, returning the logits of the
last `num_logits` positions. Many sessions of different lengths run in ONE
forward pass: rows are left-padded, each row has its own positions, and a
per-row causal mask hides padding and other rows' lengths (see kv_cache.py).

Not thread-safe: a service runs every engine call on one worker thread.
"""
from __future__ import annotations

import inspect
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.engine import vocab
from specdec.engine.config import EngineConfig
from specdec.engine.kv_cache import BatchKVView, KVShape, SessionKV
from specdec.engine.loading import free_device_memory, load_model, tokenizer_fingerprint
from specdec.errors import InvalidArgument, NotFound, OutOfRange, ResourceExhausted

log = logging.getLogger(__name__)

# Capacity a session reserves beyond its announced budget, for drafted tokens
# that are written and then rolled back.
_DRAFT_SLACK = 16


@dataclass
class Session:
    id: str
    # The context: prompt, accepted tokens, and any tokens drafted since.
    tokens: list[int]
    kv: SessionKV
    last_used: float = field(default_factory=time.monotonic)
    # The service's own per-session state (sampling parameters, seed, ...).
    meta: object = None

    @property
    def length(self) -> int:
        return len(self.tokens)


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


class ModelEngine:
    """Sessions, KV caches and batched forward passes over one causal LM."""

    def __init__(self, model: PreTrainedModel, cfg: EngineConfig, tokenizer=None, name: str = ""):
        cfg.validate()
        self.cfg = cfg
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or cfg.model or type(model).__name__
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.usable_vocab_size = vocab.usable_size(self.vocab_size, tokenizer)
        self.max_context = self._context_limit(cfg.max_context)
        self.kv_shape = self._probe_kv_shape()
        self.max_kv_bytes = cfg.max_kv_bytes or free_device_memory(self.device) // 2
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._sessions: dict[str, Session] = {}
        self.info = EngineInfo(
            model_name=self.name,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            eos_token_ids=self._eos_ids(),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer, self.vocab_size),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            kv_bytes_per_token=self.kv_shape.bytes_per_token,
            usable_vocab_size=self.usable_vocab_size,
        )

    @classmethod
    def load(cls, cfg: EngineConfig) -> "ModelEngine":
        loaded = load_model(cfg)
        return cls(loaded.model, cfg, tokenizer=loaded.tokenizer, name=loaded.name)

    # ----------------------------------------------------------- model facts

    def _context_limit(self, requested: int) -> int:
        """max_context, capped by the model's positions and attention window."""
        config = self.model.config
        limit = requested
        max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if max_pos:
            limit = min(limit, int(max_pos))
        layer_types = getattr(config, "layer_types", None) or []
        windowed = any(t != "full_attention" for t in layer_types)
        window = getattr(config, "sliding_window", None)
        if (windowed or getattr(config, "use_sliding_window", False)) and window:
            # The engine's mask is plain causal attention (kv_cache.py).
            limit = min(limit, int(window))
        return limit

    def _probe_kv_shape(self) -> KVShape:
        """Read the KV geometry off a one-token forward (any architecture)."""
        probe = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device),
                       past_key_values=probe, use_cache=True)
        layers = probe.layers
        keys, values = layers[0].keys, layers[0].values
        return KVShape(
            num_layers=len(layers),
            kv_heads=keys.shape[1],
            head_dim=keys.shape[3],
            value_dim=values.shape[3],
            dtype=keys.dtype,
            device=keys.device,
        )

    def _eos_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return tuple(sorted(i for i in ids if 0 <= i < self.vocab_size))

    def warmup(self) -> None:
        """Run the prefill, batched and single-token paths once, so the first
        real request does not pay for lazy initialization."""
        a = self.open_session([0] * 8)
        b = self.open_session([0] * 3)
        try:
            self.extend([ExtendItem(a.id, None, [0] * 4, 5), ExtendItem(b.id, None, [0], 2)])
            self.extend([ExtendItem(a.id, 6, [0], 1)])
        finally:
            self.close(a.id)
            self.close(b.id)

    # -------------------------------------------------------------- sessions

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def kv_bytes_reserved(self) -> int:
        # list() snapshots the sessions in one step: the metrics thread reads
        # this while the engine thread opens and closes sessions.
        return sum(s.kv.nbytes for s in list(self._sessions.values()))

    def session(self, session_id: str) -> Session:
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise NotFound(f"unknown or expired session {session_id!r}") from None
        session.last_used = time.monotonic()
        return session

    def open_session(self, prompt: Sequence[int], max_new_tokens: int = 0) -> Session:
        """Create a session and prefill its prompt.

        The last prompt token is left out of the cache: the first extend needs
        its logits anyway, so it is computed there and not twice.
        """
        prompt = list(prompt)
        if not prompt:
            raise InvalidArgument("the prompt is empty: at least one token is needed")
        self._check_tokens(prompt, "prompt")
        if max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                f"the context limit of {self.max_context} tokens"
            )
        if len(self._sessions) >= self.cfg.max_sessions:
            raise ResourceExhausted(f"too many open sessions (limit {self.cfg.max_sessions})")
        budget = max_new_tokens or self.cfg.initial_capacity
        capacity = min(self.max_context, len(prompt) + budget + _DRAFT_SLACK)
        self._check_budget(capacity * self.kv_shape.bytes_per_token)
        session = Session(id=secrets.token_urlsafe(18), tokens=[], kv=SessionKV(self.kv_shape, capacity))
        self._sessions[session.id] = session
        try:
            self._prefill(session, prompt[:-1])
        except BaseException:
            del self._sessions[session.id]
            raise
        session.tokens = prompt
        return session

    def append_tokens(self, session_id: str, tokens: Sequence[int]) -> int:
        """Append to the context without a forward pass (the next extend
        computes them); returns the new length."""
        session = self.session(session_id)
        self._check_tokens(tokens, "appended tokens")
        if session.length + len(tokens) > self.max_context:
            raise OutOfRange(f"session {session_id!r} would exceed the context limit of {self.max_context}")
        session.tokens.extend(int(t) for t in tokens)
        self._ensure_capacity(session, session.length)
        return session.length

    def rollback(self, session_id: str, length: int) -> int:
        """Keep the first `length` tokens of the context: O(1)."""
        session = self.session(session_id)
        self._check_keep(session, length)
        del session.tokens[length:]
        session.kv.truncate(min(session.kv.length, length))
        return session.length

    def close(self, session_id: str) -> bool:
        """Free a session; False if it was already gone (closing twice is harmless)."""
        return self._sessions.pop(session_id, None) is not None

    def expire_idle(self, ttl_s: float) -> list[str]:
        """Close sessions unused for ttl_s seconds; returns their ids."""
        now = time.monotonic()
        stale = [sid for sid, s in self._sessions.items() if now - s.last_used > ttl_s]
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

    def validate(self, items: Sequence[ExtendItem]) -> list[Session]:
        """Check a batch without changing anything; raises the first problem."""
        if not items:
            raise InvalidArgument("empty batch")
        ids = [item.session_id for item in items]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a session appears twice in one batch")
        sessions = [self.session(sid) for sid in ids]
        extra_bytes = 0
        for item, session in zip(items, sessions):
            keep = session.length if item.keep_length is None else item.keep_length
            self._check_keep(session, keep)
            self._check_tokens(item.tokens, "appended tokens")
            new_length = keep + len(item.tokens)
            if new_length > self.max_context:
                raise OutOfRange(
                    f"session {session.id!r} would hold {new_length} tokens, beyond the context "
                    f"limit of {self.max_context}"
                )
            if item.num_logits < 0:
                raise InvalidArgument(f"num_logits must be >= 0, got {item.num_logits}")
            if item.num_logits > new_length:
                # The first wanted position needs a token before it.
                raise InvalidArgument(
                    f"nothing precedes the positions asked for ({item.num_logits} logits from a context of "
                    f"{new_length} tokens): keep or append at least one token"
                )
            extra_bytes += self._growth_bytes(session, new_length)
        self._check_budget(extra_bytes)
        return sessions

    def _apply_cut_and_append(self, session: Session, item: ExtendItem) -> None:
        keep = session.length if item.keep_length is None else item.keep_length
        del session.tokens[keep:]
        session.tokens.extend(int(t) for t in item.tokens)
        # The positions whose logits are wanted must be recomputed.
        session.kv.truncate(min(session.kv.length, keep, session.length - item.num_logits))
        self._ensure_capacity(session, session.length)

    def _prefeed_long(self, session: Session, num_logits: int) -> None:
        """Feed, alone and in chunks, the part of a long pending run whose
        logits are not wanted, so a batched step stays small."""
        chunk = self.cfg.prefill_chunk
        while session.length - session.kv.length > max(chunk, num_logits):
            start = session.kv.length
            stop = min(start + chunk, session.length - max(num_logits, 1))
            self._run([session], [session.tokens[start:stop]], logits_to_keep=0)

    def _prefill(self, session: Session, tokens: list[int]) -> None:
        session.tokens = list(tokens)
        chunk = self.cfg.prefill_chunk
        for start in range(0, len(tokens), chunk):
            self._run([session], [tokens[start : start + chunk]], logits_to_keep=0)

    def _forward(self, sessions: list[Session], num_logits: list[int]) -> list[torch.Tensor]:
        feeds = [s.tokens[s.kv.length :] for s in sessions]
        keep = max(num_logits)
        logits = self._run(sessions, feeds, logits_to_keep=keep)  # [B, keep, V]
        vocab.mask_padding_(logits, self.usable_vocab_size)  # padded rows never sampled
        return [logits[b, keep - n :] for b, n in enumerate(num_logits)]

    def _run(self, sessions: list[Session], feeds: list[list[int]], logits_to_keep: int) -> torch.Tensor:
        """One forward pass; rows left-padded; returns the last logits_to_keep columns."""
        counts = [len(f) for f in feeds]
        n_max = max(counts)
        if n_max == 0:
            return torch.empty((len(feeds), 0, self.vocab_size), dtype=self.dtype, device=self.device)
        view = BatchKVView([s.kv for s in sessions], counts)
        input_ids = torch.zeros((len(feeds), n_max), dtype=torch.long)
        positions = torch.zeros((len(feeds), n_max), dtype=torch.long)
        for b, feed in enumerate(feeds):
            n = counts[b]
            input_ids[b, n_max - n :] = torch.tensor(feed, dtype=torch.long)
            # Padding columns (j < 0) repeat the first real position.
            j = (torch.arange(n_max) - (n_max - n)).clamp(min=0)
            positions[b] = view.starts[b] + j
        mask = self._mask(positions, view.kv_length)
        kwargs = {"logits_to_keep": max(logits_to_keep, 1)} if self._keeps_logits else {}
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids.to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=mask,
                past_key_values=view,
                use_cache=True,
                **kwargs,
            )
        view.commit()
        return out.logits[:, out.logits.shape[1] - logits_to_keep :] if logits_to_keep else out.logits[:, :0]

    def _mask(self, positions: torch.Tensor, kv_length: int) -> torch.Tensor:
        """[B, 1, n, kv_length]: query at position t sees keys 0..t of its row."""
        allowed = torch.arange(kv_length).view(1, 1, 1, -1) <= positions.view(*positions.shape[:2], 1).unsqueeze(1)
        allowed = allowed.to(self.device)
        if self.cfg.attn_implementation == "sdpa":
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    # ------------------------------------------------------------ the limits

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        for t in tokens:
            if not 0 <= int(t) < self.usable_vocab_size:
                raise InvalidArgument(f"{what}: token id {int(t)} outside the vocabulary [0, {self.usable_vocab_size})")

    def _check_keep(self, session: Session, length: int) -> None:
        if length < 0:
            raise InvalidArgument(f"length must be >= 0, got {length}")
        if length > session.length:
            raise OutOfRange(
                f"cannot keep {length} tokens: session {session.id!r} holds only {session.length}"
            )

    def _growth_bytes(self, session: Session, length: int) -> int:
        new_capacity = self._grown_capacity(session.kv.capacity, length)
        return (new_capacity - session.kv.capacity) * self.kv_shape.bytes_per_token

    def _grown_capacity(self, capacity: int, length: int) -> int:
        if length <= capacity:
            return capacity
        return min(self.max_context, max(2 * capacity, length + _DRAFT_SLACK))

    def _ensure_capacity(self, session: Session, length: int) -> None:
        capacity = self._grown_capacity(session.kv.capacity, length)
        if capacity > session.kv.capacity:
            session.kv.grow(capacity)

    def _check_budget(self, extra_bytes: int) -> None:
        if self.kv_bytes_reserved + extra_bytes > self.max_kv_bytes:
            raise ResourceExhausted(
                f"KV cache budget exhausted: {self.kv_bytes_reserved + extra_bytes} bytes needed, "
                f"limit {self.max_kv_bytes} (close sessions or raise --max-kv-bytes)"
            )
