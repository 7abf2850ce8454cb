"""Whether a bench's models fit the memory they will share, checked before
anything loads.

`specd bench` loads the target in its service and, for the HF baselines, again
in its own process (and the draft twice for HF assisted generation), all on
the devices the flags name. A pair too large for them fails minutes in: on a
CPU the kernel's OOM killer ends a service (or the bench) with no message of
ours, and on a GPU a load raises out of memory. So `bench_options` counts the
weights first, from the models' configs (on torch's meta device: no memory,
no weights read), and refuses a run whose weights alone exceed what the
device has free, naming what would load where.

Each copy is counted as it is held once loaded:

- in its own dtype: `--dtype auto` resolves per device (engine/loading.py's
  `resolve_dtype`), so a CPU draft beside a CUDA target may hold fp32 while
  the target holds bf16 (`element_bytes`);
- once per draft service: `--draft-vocab 0 16384` starts one draft service
  per head, all at once (bench/services.py `start_models`), each with its own
  copy of the draft;
- with its head as held (engine/draft_vocab.py `restrict_head`): a trimmed
  head is a new matrix of its rows; an untied full head is dropped for it, a
  tied one stays as the input embedding, so the trimmed rows come on top;
- int8 (`--draft-quantize int8`, engine/quantize.py): every `nn.Linear`, the
  head included, becomes int8 weights and a scale per output row; the rest
  (embedding, norms, biases) keeps its width. A tied head gets an int8 copy
  beside the embedding it shared. Packing (engine/packed_linear.py) re-blocks
  bf16 linears at the same size, so it changes nothing here.

Only the weights are counted: the KV store sizes itself to what is free after
them (`--max-kv-bytes` aside), a process's own few hundred MB are left out, and
so is a load's passing peak (a draft is loaded at full width before it is
trimmed or quantized), so a run this lets through may still be tight; one it
refuses cannot fit.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

GIB = 2**30

# Bytes an int8 linear keeps per output row beside its int8 weights: its scale
# (engine/quantize.py, `Int8Linear.weight_nbytes`).
INT8_ROW_BYTES = 8


@dataclass(frozen=True)
class Load:
    """One copy of a model's weights that a run holds on a device."""

    what: str  # e.g. "target (service)"
    device: str
    nbytes: int


@dataclass(frozen=True)
class Shape:
    """What the byte counts need of a model's architecture."""

    params: int  # every parameter, a tied head once (with the embedding)
    linear: int  # elements of the nn.Linear weights, the output head's included
    linear_rows: int  # their output rows: an int8 linear keeps a scale for each
    head_rows: int  # the output head's rows (the vocabulary)
    hidden: int  # the output head's columns
    tied: bool  # the head is the input embedding's matrix

    @property
    def head(self) -> int:
        return self.head_rows * self.hidden


@dataclass(frozen=True)
class Placement:
    """A model, where it runs and how it is held there."""

    model: str
    device: str
    width: int  # bytes per element: its dtype as resolved for its own device
    heads: tuple[int, ...] = (0,)  # its services' output heads, one service each (0: the full head)
    int8: bool = False  # its linears quantized (--draft-quantize int8)


def element_bytes(dtype: str, device: str) -> int:
    """Bytes per weight element of a model loaded with `--dtype dtype` on
    `device`: each model's own device decides what `auto` means."""
    from specdec.engine.loading import resolve_dtype

    return torch.empty(0, dtype=resolve_dtype(dtype, device)).element_size()


def model_shape(model: str) -> Shape | None:
    """The shape of a synth:NAME model or a model directory, from its config
    alone (None: no config here)."""
    from specdec.models.skeleton import model_config

    config = model_config(model)
    return None if config is None else config_shape(config)


def config_shape(config) -> Shape | None:
    """The shape of a model built from `config` on torch's meta device (no
    memory, no weights); None where transformers cannot build it."""
    from specdec.models.skeleton import meta_model

    try:
        skeleton = meta_model(config)
    except (ValueError, KeyError, TypeError):
        return None
    linears = [m for m in skeleton.modules() if isinstance(m, torch.nn.Linear)]
    head, embedding = skeleton.get_output_embeddings(), skeleton.get_input_embeddings()
    return Shape(params=sum(p.numel() for p in skeleton.parameters()),  # a tied head counts once
                 linear=sum(m.weight.numel() for m in linears), linear_rows=sum(m.out_features for m in linears),
                 head_rows=int(head.weight.shape[0]), hidden=int(head.weight.shape[1]),
                 tied=embedding is not None and head.weight is embedding.weight)


def copy_bytes(shape: Shape, width: int, head: int = 0, int8: bool = False) -> int:
    """Bytes one loaded copy holds: elements of `width` bytes, its output head
    trimmed to `head` rows (0: full), its linears int8 or not."""
    rows = min(head, shape.head_rows) if head else shape.head_rows
    # A tied full head is the embedding itself, until int8 makes it a copy of its own.
    own_head = not shape.tied or rows < shape.head_rows or int8
    head_elements = rows * shape.hidden if own_head else 0
    body_linear = shape.linear - shape.head  # the linears but the head
    rest = shape.params - body_linear - (0 if shape.tied else shape.head)  # embedding, norms, biases, ...
    if not int8:
        return width * (rest + body_linear + head_elements)
    rows_scaled = shape.linear_rows - shape.head_rows + (rows if own_head else 0)
    return width * rest + body_linear + head_elements + INT8_ROW_BYTES * rows_scaled


def _head_label(head: int, heads: tuple[int, ...]) -> str:
    """Which head a draft service's copy has, where there are several to tell apart."""
    if len(heads) < 2:
        return ""
    return " full head" if head == 0 else f" head {head}"


def loads(draft: Placement, target: Placement, services: bool, hf_target: bool, hf_draft: bool) -> list[Load]:
    """The copies of the weights a run holds: the services' (the target's, and
    one draft per head: they run at once) and the HF baselines' (in the bench's
    own process, on the same devices, the full head; the assisted draft int8
    like the service's); a model whose size is unknown here is left out."""
    out = []
    for name, place, in_service, in_hf in (("target", target, services, hf_target),
                                           ("draft", draft, services, hf_draft)):
        shape = model_shape(place.model) if (in_service or in_hf) else None
        if shape is None:
            continue
        if in_service:
            for head in place.heads:
                out.append(Load(f"{name}{_head_label(head, place.heads)} (service)", place.device,
                                copy_bytes(shape, place.width, head, place.int8)))
        if in_hf:
            out.append(Load(f"{name} (HF baselines)", place.device, copy_bytes(shape, place.width, 0, place.int8)))
    return out


def overcommitted(run: list[Load], free_bytes) -> str | None:
    """Why the run's weights cannot fit (None: they can); `free_bytes(device)` gives what is free."""
    by_device: dict[str, list[Load]] = defaultdict(list)
    for load in run:
        device = torch.device(load.device)
        by_device["cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"].append(load)
    for device, items in by_device.items():
        need = sum(item.nbytes for item in items)
        free = free_bytes(device)
        if need > free:
            parts = ", ".join(f"{item.what} {item.nbytes / GIB:.1f}" for item in items)
            return (f"the models' weights need {need / GIB:.1f} GiB on {device} ({parts}) and {free / GIB:.1f} GiB "
                    "is free there")
    return None
