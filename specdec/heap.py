"""What start-up makes stays out of the cyclic garbage collector's full passes.

A role's start-up leaves hundreds of thousands of Python objects that live as
long as the process: modules, torch's and transformers' internals, the
model's modules, the tokenizer, protobuf descriptors. CPython's collector
walks every one of them in each full (generation 2) collection, which comes
once enough objects have outlived the young generations: a request's
objects do, when it lasts longer than a few young collections. On the dev VM
a full collection costs a service ~0.3 s and the orchestrator ~0.1 s (the
process stopped meanwhile), paid by whichever round it lands in.

Start-up pays the same walks many times over: its imports grow the heap
from nothing to ~400k objects, and each time it has grown by a quarter a
full collection walks all of it. A service process made 6 such collections
while it imported, 0.07 to 0.66 s each, 2.2 s of its start (none while it
served rounds; docs/benchmarks.md, "Start-up's garbage collections").

- `importing()` wraps a role's imports: no collection runs inside, and what
  they made is frozen (`gc.freeze`: moved to a permanent generation the
  collector never walks) as they end. Imports make next to no garbage.
- `settle()`, once the role is SERVING (its model loaded, with the collector
  on), collects what start-up left as garbage and freezes everything alive,
  so that later full collections walk only what serving made.

Set `SPECD_GC_FREEZE=0` to leave the collector as CPython sets it.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os

log = logging.getLogger(__name__)

ENV = "SPECD_GC_FREEZE"


def _off() -> bool:
    return os.environ.get(ENV, "1").strip() == "0"


@contextlib.contextmanager
def importing():
    """No collection while the block imports; what it made is frozen after."""
    if _off() or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        _freeze()
        gc.enable()


def _freeze() -> None:
    """`gc.freeze()`, undone as the interpreter exits, so that its last
    collection still frees what is frozen (extension modules that check for
    leaks at exit, such as triton's nanobind bindings, would report every
    frozen object of theirs as leaked)."""
    _thaw_at_exit()
    gc.freeze()


@functools.cache
def _thaw_at_exit() -> None:
    atexit.register(gc.unfreeze)  # once per process


def settle() -> int:
    """Collect, then freeze every object alive out of later collections
    (unless `SPECD_GC_FREEZE=0`). Returns how many objects are frozen."""
    if _off():
        log.info("the collector walks start-up's objects too (%s=0)", ENV)
        return 0
    gc.collect()
    _freeze()
    frozen = gc.get_freeze_count()
    log.info("%d objects from start-up frozen out of garbage collection", frozen)
    return frozen
