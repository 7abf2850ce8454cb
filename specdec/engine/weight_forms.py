"""What may be done to an engine's weights once they are loaded, before its
CUDA graphs are captured: trim the output head to a draft vocabulary
(draft_vocab.py), quantize the linears to int8 (quantize.py), pack bf16
linears for oneDNN (packed_linear.py). `ModelEngine` takes these methods
from `WeightForms`; `ModelEngine.load` applies what the config asks for."""
from __future__ import annotations

import dataclasses
import logging

import torch

from specdec.engine.draft_vocab import restrict_head
from specdec.engine.packed_linear import bf16_packing_runs, is_packed, pack_linears, packable
from specdec.engine.quantize import is_quantized, quantize_linears

log = logging.getLogger(__name__)


class WeightForms:
    """Mixed into ModelEngine: uses its model, device, dtype, steps,
    vocab_size, output_ids and quantized."""

    def restrict_output(self, ids: torch.Tensor) -> None:
        """Compute logits for these token ids only, -inf for the rest (a
        trimmed draft vocabulary, draft_vocab.py). Before warmup: a captured
        graph keeps the head it was captured with."""
        assert self.steps is None or not self.steps.captured, "restrict the head before capturing graphs"
        if is_quantized(self.model) or is_packed(self.model):
            raise ValueError("restrict the output head before quantizing or packing the model")
        restrict_head(self.model, ids)
        self.output_ids = int(ids.numel())
        log.info("output head restricted to %d of %d token ids", self.output_ids, self.vocab_size)

    def quantize_weights(self, kind: str) -> None:
        """Run every linear layer, the output head included (trimmed or not),
        with int8 weights (quantize.py). The draft's q stays its real
        distribution: that of the quantized model."""
        if kind != "int8":
            raise ValueError(f"quantize must be none or int8, not {kind!r}")
        if self.device.type != "cpu":
            raise ValueError("--quantize int8 runs on the CPU only (fbgemm has no CUDA kernel)")
        assert self.steps is None or not self.steps.captured, "quantize before capturing graphs"
        if is_packed(self.model):
            raise ValueError("quantize the model before packing its linears")
        with torch.inference_mode(False), torch.no_grad():
            replaced = quantize_linears(self.model)
        self.quantized = kind
        self.info = dataclasses.replace(self.info, weights=kind)
        log.info("%d linear layers quantized to int8 (fbgemm)", replaced)

    def pack_weights(self) -> None:
        """Run the bf16 linear layers on weights blocked once for oneDNN
        (packed_linear.py): the same products, bit for bit, read faster."""
        if not packable(self.device, self.dtype):
            raise ValueError("packed linears are for bf16 models on the CPU")
        if not bf16_packing_runs():
            raise ValueError("packed linears need oneDNN's bf16 products, which this CPU lacks "
                             "(AVX512 BW/VL/DQ or AVX-NE-CONVERT)")
        with torch.inference_mode(False), torch.no_grad():
            replaced = pack_linears(self.model)
        log.info("%d bf16 linear layers packed for oneDNN", replaced)
