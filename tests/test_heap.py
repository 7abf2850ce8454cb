"""specdec/heap.py: what start-up made is frozen out of the collector."""
from __future__ import annotations

import gc
import weakref

import pytest

from specdec import heap


class _Node:
    next = None


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's objects go back to the collector


def test_settle_freezes_what_is_alive_and_later_objects_are_collected(unfrozen):
    """The count is read, not compared: other threads of the test process may
    free frozen objects meanwhile (by reference count), which lowers it."""
    kept = [[i] for i in range(100)]  # lists: objects the collector tracks
    frozen = heap.settle()
    assert frozen > len(kept) and gc.get_freeze_count() > 0
    assert not _in_collector(kept)  # frozen: no collection walks them
    cycle = _Node()
    cycle.next = cycle  # garbage only the collector finds, once dropped
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert gone() is None
    assert not _in_collector(kept)  # a later collection leaves the frozen as they were


def _in_collector(objects) -> bool:
    """Whether any of `objects` is in a generation the collector walks."""
    ids = {id(obj) for obj in objects}
    return any(id(obj) in ids for obj in gc.get_objects())


def test_settle_leaves_the_collector_as_it_is_when_told_to(unfrozen, monkeypatch):
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.settle() == 0 and gc.get_freeze_count() == 0
