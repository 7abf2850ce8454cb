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
    kept = [object() for _ in range(100)]
    frozen = heap.settle()
    assert frozen == gc.get_freeze_count() > len(kept)
    cycle = _Node()
    cycle.next = cycle  # garbage only the collector finds, once dropped
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert gone() is None
    assert gc.get_freeze_count() == frozen  # a later collection leaves the frozen as they were


def test_settle_leaves_the_collector_as_it_is_when_told_to(unfrozen, monkeypatch):
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.settle() == 0 and gc.get_freeze_count() == 0
