"""The engine passes its KV cache under the keyword the installed
transformers takes: `past_key_values` up to 5.2x, `cache` after (the old name
is deprecated there and removed in 5.40, after which a forward would swallow
it in **kwargs and run on a cache of its own, with our store left unwritten)."""
from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdec.engine.fused_decoder import FusedDecoder
from specdec.engine.model_facts import cache_kwarg, output_cache


class _OldForward(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False, **kwargs):
        return past_key_values


class _NewForward(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False, **kwargs):
        return cache


def test_the_keyword_follows_the_forward_signature():
    assert cache_kwarg(_OldForward()) == "past_key_values"
    assert cache_kwarg(_NewForward()) == "cache"
    assert cache_kwarg(FusedDecoder.__new__(FusedDecoder)) == "cache"


def test_the_installed_transformers_uses_the_cache_it_is_given_without_a_deprecation():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_kwarg(model): cache})
    assert output_cache(out) is cache  # our cache was the one written, not one the forward made
    assert cache.get_seq_length() == 3
