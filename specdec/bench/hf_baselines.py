"""In-process baselines: plain transformers `generate` with the target (its
default dynamic cache, eager), `generate` on a static cache (compiled with
torch.compile on CUDA, as transformers does by default there: the strongest
plain HF decoding), and HF assisted generation
(`generate(..., assistant_model=draft)`).

Both models are loaded in the bench process through the engine's own loader
(`specdec.engine.loading.load_model`), so they get the services' dtype
resolution, device and thread count. Sampling parameters are passed in full
(no top-k, top-p 1, no repetition penalty) so a model's generation_config
cannot change them; the assistant keeps transformers' defaults for its
lookahead schedule, as a user of assisted generation gets them.
"""
from __future__ import annotations

import time

from specdec.bench.services import peak_rss_mb, reset_peak_rss


def _eos_ids(model, tokenizer) -> list[int]:
    """The target's end-of-sequence ids as the target service computes them
    (generation_config and config), plus the tokenizer's, as the orchestrator adds."""
    from specdec.engine.model_facts import eos_ids

    ids = set(eos_ids(model))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def _make_streamer():
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        """Timestamps every batch of new tokens generate() hands over; the
        first put() is the prompt and is skipped."""

        def __init__(self):
            self.start = time.perf_counter()
            self.arrivals: list[tuple[float, int]] = []
            self._prompt_seen = False

        def put(self, value) -> None:
            now = time.perf_counter()
            if not self._prompt_seen:
                self._prompt_seen = True
                return
            self.arrivals.append((now - self.start, int(value.numel())))

        def end(self) -> None:
            pass

    return TimingStreamer()


def _rows(model) -> int:
    return int(model.config.get_text_config().vocab_size)


def match_rows(draft, rows: int) -> None:
    """Give the draft the target's `rows` for transformers' assisted
    generation, which takes models whose rows differ for models with
    different tokenizers and refuses them without both tokenizers (Qwen2.5's
    0.5B has 151,936 rows and its 7B 152,064: the same tokenizer, padded
    differently). The draft proposes what it proposed before:
    - fewer rows than the target's: rows are added, and the draft's logits
      there are -inf, so its distribution over its own rows is unchanged and
      it never proposes an added id; an id the target emits there (a padding
      row of its own) still has an embedding to read;
    - more rows: the rows past the target's are cut, ids the target cannot
      read (padding of the draft's)."""
    own = _rows(draft)
    draft.resize_token_embeddings(rows, mean_resizing=False)
    assert _rows(draft) == rows and draft.get_output_embeddings().weight.shape[0] == rows
    if own < rows:
        # On the model's output, not its head: quantizing or packing the
        # draft later replaces the head's module.
        def mask(model, args, kwargs, output):
            logits = output[0] if isinstance(output, tuple) else output.logits  # (return_dict=False: a tuple)
            logits[..., own:] = float("-inf")
            return output

        draft.register_forward_hook(mask, with_kwargs=True)


class HFBaselines:
    """The target (and, for assisted generation, the draft) loaded in this process."""

    def __init__(self, target_cfg, draft_cfg=None, packed_linears: str = "off"):
        from transformers.utils import logging as hf_logging

        from specdec.engine.loading import load_model

        hf_logging.disable_progress_bar()  # the bench reports its own progress
        hf_logging.set_verbosity_error()  # generate()'s deprecation notices about its own internals
        self.target_cfg = target_cfg
        # hf-static's cache length for every request (None: transformers sizes
        # it per request, and a longer request then recompiles the step).
        self.static_cache_len: int | None = None
        loaded = load_model(target_cfg)
        self.target = loaded.model
        self.tokenizer = loaded.tokenizer
        self.draft = load_model(draft_cfg).model if draft_cfg is not None else None
        self.draft_rows = None  # (the draft's rows, the target's) when they differed and were matched
        if self.draft is not None:
            rows = _rows(self.draft), _rows(self.target)
            if rows[0] != rows[1]:
                match_rows(self.draft, rows[1])
                self.draft_rows = rows
        if self.draft is not None and self._draft_int8(draft_cfg):
            from specdec.engine.quantize import quantize_linears

            quantize_linears(self.draft)  # the same int8 draft as the draft service's (engine/quantize.py)
        self.packed = self._pack(packed_linears)
        self.eos_ids = _eos_ids(self.target, self.tokenizer)
        pad = getattr(self.target.config, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.device = self.target.device
        self.dtype = str(self.target.dtype).removeprefix("torch.")

    def _draft_int8(self, draft_cfg) -> bool:
        """The draft's linears as int8: as asked, or (auto) as the draft
        service would choose for this draft (engine/quantize.py)."""
        from specdec.engine.quantize import choose_for

        return choose_for(getattr(draft_cfg, "quantize", "none"), self.draft.device.type, self.draft.config)[0] == "int8"

    def _pack(self, setting: str) -> bool:
        """`specd bench --hf-packed-linears auto`: the baselines' bf16 linears
        on pre-packed weights like the services' (engine/packed_linear.py), a
        what-if; by default (off) transformers runs as it comes, F.linear."""
        import torch

        from specdec.engine.packed_linear import pack_linears, wants_packing

        if not wants_packing(setting, self.target.device, self.target.dtype):
            return False
        with torch.no_grad():
            for model in (self.target, self.draft):
                if model is not None:
                    pack_linears(model)
        return True

    def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, seed: int,
                 kind: str = "hf") -> dict:
        """One request of `kind` (hf, hf-static or hf-assisted): tokens,
        timings (client-side style), bench-process peak memory."""
        import torch
        from transformers import GenerationConfig

        assert kind in ("hf", "hf-static", "hf-assisted"), kind
        assisted = kind == "hf-assisted"
        if assisted and self.draft is None:
            raise RuntimeError("assisted generation needs the draft model loaded")
        sample = temperature > 0
        params = dict(max_new_tokens=max_tokens, do_sample=sample, repetition_penalty=1.0,
                      eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id)
        if sample:  # the full distribution at this temperature, as the services sample
            params.update(temperature=temperature, top_k=0, top_p=1.0)  # top_k 0: off (unset is 50)
        if kind == "hf-static":
            # transformers compiles the forward over a static cache itself on
            # CUDA; on a CPU, compiling would mostly measure the compiler.
            params.update(cache_implementation="static", disable_compile=self.device.type != "cuda")
            if self.static_cache_len:  # one shape: the warm-up compiles what every request runs
                params.update(max_cache_len=max(self.static_cache_len, len(prompt_ids) + max_tokens))
        config = GenerationConfig(**params)
        ids = torch.tensor([prompt_ids], device=self.device)
        cuda = self.device.type == "cuda"
        reset_peak_rss("self")
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        torch.manual_seed(seed)
        streamer = _make_streamer()
        extra = {"assistant_model": self.draft} if assisted else {}
        with torch.inference_mode():
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                       streamer=streamer, **extra)
        tokens = out[0, len(prompt_ids):].tolist()
        wall = time.perf_counter() - streamer.start
        finish = "length"
        for i, t in enumerate(tokens):
            if t in self.eos_ids:  # the orchestrator does not emit the end-of-sequence token
                tokens, finish = tokens[:i], "eos"
                break
        return {
            "token_ids": tokens,
            "wall_s": wall,
            "ttft_s": streamer.arrivals[0][0] if streamer.arrivals else None,
            "arrivals": streamer.arrivals,
            "finish_reason": finish,
            "peak_mb": {"bench": peak_rss_mb("self")},
            "gpu_mb": {"bench": torch.cuda.max_memory_allocated(self.device) / 2**20} if cuda else None,
        }
