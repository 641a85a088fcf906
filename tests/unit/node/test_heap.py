"""The heap freezer: long-lived objects leave the full collections, dead cycles do not stay."""

from __future__ import annotations

import gc
import weakref

from geofed.node import HeapFreezer


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_heap_is_frozen_as_the_subscriptions_grow() -> None:
    freezer = HeapFreezer(least=100, growth=1.25)
    try:
        assert not freezer.held(99) and freezer.freezes == 0
        assert freezer.held(100) and gc.get_freeze_count() > 0
        assert not freezer.held(124)  # less than a quarter more
        assert freezer.held(125) and freezer.freezes == 2
        assert not freezer.held(10)  # shrinking never freezes
    finally:
        gc.unfreeze()


def test_a_cycle_that_died_frozen_is_collected_at_the_next_freeze() -> None:
    freezer = HeapFreezer(least=1, growth=2.0)
    try:
        cycle = _Node()
        alive = weakref.ref(cycle)
        assert freezer.held(1)
        del cycle
        gc.collect()
        assert alive() is not None  # frozen: out of the collector's reach
        assert freezer.held(2)
        assert alive() is None
    finally:
        gc.unfreeze()
