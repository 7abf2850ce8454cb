"""Int8 weights for a draft on the CPU (`--quantize int8`).

A decode step of a small model on a CPU is a chain of matrix-vector
products; torch's bf16 GEMM runs them well below the memory bandwidth
(docs/benchmarks.md "An int8 draft"). fbgemm's dynamic int8 linear (VNNI on
x86) reads half the bytes and runs at a much higher share of the bandwidth,
so every `nn.Linear` of the model, the output head included (also a trimmed
one, `SubsetHead.proj`), becomes an `Int8Linear`:

- weights: int8, symmetric, one scale per output channel, quantized once at
  load time;
- activations: int8 per token. fbgemm quantizes its whole input with one
  range (its min and max), so each row is divided by its own absolute
  maximum first, a sentinel row holding 1 and -1 fixes the range at
  [-1, 1], and each output row is multiplied back: a token's logits then do
  not depend on which other tokens share its step;
- the bias is added in the model's dtype after the product;
- sibling projections of one input (q, k and v; gate and up) are stacked into
  one Int8Linear and share its product (fused_linears.py): per output channel
  and per row nothing changes, so the results are the same bit for bit, and
  a step pays the fixed cost of a product 97 times instead of 169 (0.5B).

Exact by construction, like the trimmed head: the draft's q is the quantized
model's own distribution, the one its tokens are sampled from, and rejection
sampling is exact for any q. A quantized target would be a different model,
so the target service refuses the option (`refuse_for_target`).

CPU only: fbgemm has no CUDA kernel (`EngineConfig.validate` says so).

`--quantize auto`, the draft's default, picks int8 where it was measured to
pay (`choose`): a draft on a CPU with VNNI and fbgemm whose hidden size is at
least AUTO_MIN_HIDDEN. Below that a product is too small for int8 to gain
(an 896 x 4864 product costs 3.8x less in int8 on the dev VM, 512 x 2048
2.1x, 256 x 1024 about the same, 64 x 256 more), so tiny test models keep
their dtype. A target never resolves auto to int8.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from specdec.engine.cpu_features import has_any
from specdec.engine.fused_linears import fuse_siblings, replace_linears


# The smallest hidden size at which `auto` quantizes a draft (see above).
AUTO_MIN_HIDDEN = 512


def _cpu_has_vnni() -> bool:
    return has_any("avx512_vnni", "avx_vnni", "amx_int8")


def choose_for(setting: str, device: str, config) -> tuple[str, str]:
    """`choose` for a model of this transformers `config` (None: unknown)."""
    return choose(setting, device, getattr(config, "hidden_size", None))


def choose(setting: str, device: str, hidden_size: int | None) -> tuple[str, str]:
    """What a draft's `--quantize` setting means here: ("none" or "int8",
    why). `auto` quantizes only where int8 was measured to pay."""
    if setting != "auto":
        return setting, "asked for"
    if device != "cpu":
        return "none", f"auto: the model runs on {device}, and fbgemm's int8 kernels are the CPU's"
    if not _cpu_has_vnni():
        return "none", "auto: this CPU has no VNNI, where int8 was not measured to pay"
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "none", "auto: this torch has no fbgemm"
    if not hidden_size:
        return "none", "auto: the model's hidden size is unknown"
    if hidden_size < AUTO_MIN_HIDDEN:
        return "none", f"auto: hidden size {hidden_size} is below {AUTO_MIN_HIDDEN}, where int8 products cost no less"
    return "int8", f"auto: a CPU with VNNI, hidden size {hidden_size}"


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights (per output channel) and int8 per-token
    activations, computed by fbgemm; same input and output dtype as before."""

    def __init__(self, linear: nn.Linear, reduce_range: bool | None = None):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; fbgemm's ops stay
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated")
            qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        sentinel = torch.zeros(1, self.in_features)
        sentinel[0, 0], sentinel[0, -1] = 1.0, -1.0
        self.register_buffer("sentinel", sentinel, persistent=False)
        self.out_dtype = linear.weight.dtype
        # Without VNNI fbgemm's int16 accumulation can saturate on 8-bit activations.
        self.reduce_range = (not _cpu_has_vnni()) if reduce_range is None else reduce_range

    @property
    def weight_nbytes(self) -> int:
        """Bytes a forward reads for the weights: int8 values and the scales."""
        return self.in_features * self.out_features + 8 * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        # Every row now lies in [-1, 1]; the sentinel row spans exactly that,
        # so fbgemm's one range is always [-1, 1] whatever the other rows.
        rows = torch.cat([rows / peak, self.sentinel])
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)[:-1] * peak
        out = out.to(self.out_dtype).reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (fbgemm)"


def quantize_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by an Int8Linear (in place), sibling
    projections of one input as one product (fused_linears.py, the same
    results bit for bit); returns how many linears were replaced."""
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    fuse_siblings(model, Int8Linear)
    replace_linears(model, Int8Linear)
    return before


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def refuse_for_target(quantize: str) -> None:
    """The target defines the output distribution: a quantized target is
    another model, so the target service never runs one."""
    if quantize not in ("none", "auto"):  # auto never quantizes a target
        raise ValueError(f"--quantize {quantize} is for the draft only: the target defines the output "
                         "distribution, and a quantized target is a different model")
