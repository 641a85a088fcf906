"""The heap freezer: long-lived objects leave the full collections, dead cycles do not stay."""

from __future__ import annotations

import gc
import weakref

from geofed.node import HeapFreezer
from geofed.node._heap import YOUNG_THRESHOLD


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_heap_is_frozen_as_the_subscriptions_grow() -> None:
    thresholds = gc.get_threshold()
    freezer = HeapFreezer(least=100, growth=1.25)
    try:
        assert not freezer.held(99) and freezer.freezes == 0
        assert freezer.held(100) and gc.get_freeze_count() > 0
        assert not freezer.held(124)  # less than a quarter more
        assert freezer.held(125) and freezer.freezes == 2
        assert not freezer.held(10)  # shrinking never freezes
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_the_first_freeze_lets_young_objects_die_before_they_are_walked() -> None:
    before = gc.get_threshold()
    freezer = HeapFreezer(least=1, growth=2.0)
    try:
        gc.set_threshold(700, before[1], before[2])
        assert freezer.held(1)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        gc.set_threshold(50_000, before[1], before[2])
        assert freezer.held(2)  # a later freeze leaves the thresholds as they are
        assert gc.get_threshold()[0] == 50_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_cycle_that_died_frozen_is_collected_at_the_next_freeze() -> None:
    thresholds = gc.get_threshold()
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
        gc.set_threshold(*thresholds)
