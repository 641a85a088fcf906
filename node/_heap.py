"""Keeping the node's long-lived state out of Python's full garbage collections.

A node holding 100,000 subscriptions has about 800,000 objects the cyclic
collector tracks (subscriptions, geofence parts, index entries); one full
collection walks all of them, 0.65 s of CPU on the benchmark machine
(`bench/results/node.md`). Python starts one whenever the objects that
survived into the oldest generation grew by a quarter of it, and a busy
publish path promotes its short-lived objects there (a batch of 1,000
events keeps its outcomes alive until it is committed): every ~20,000
world-wide events cost one full pass, about 30 µs per event.

`HeapFreezer` moves everything alive into the permanent generation
(`gc.freeze`) once the subscriptions held grew by a quarter since the last
time, so the full passes walk only what is young. Frozen objects are still
freed by reference counting when they are dropped (subscriptions, geofences
and index entries hold no reference cycles); a cycle that became garbage
while frozen is collected at the next freeze, which first unfreezes,
collects and then freezes again. That one collection costs what Python's own
full pass at the same growth would have.

The first freeze also raises the collector's thresholds (`YOUNG_THRESHOLD`):
with Python's default (a young pass every 700 new objects, a middle one every
10 young ones) a batch of 1,000 events, whose ~30,000 objects live until its
commit, is promoted generation by generation and walked again there, and the
full passes it then starts walk everything that arrived since the last freeze
(tens of ms each). A node of the benchmark's size spent ~10 µs of CPU per
world-wide event in the collector that way, ~4 with young passes every
20,000 objects, where most of a batch dies before it is walked and no
middle or full pass ran in the run (bench/results/node.md, 2026-11-27).
Garbage in cycles waits at most that many allocations longer.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("geofed.node")

FREEZE_GROWTH = 1.25  # refreeze once the subscriptions held grew by this factor
FREEZE_LEAST = 10_000  # below this many subscriptions a full pass is cheap: never freeze
YOUNG_THRESHOLD = 20_000  # new objects between young passes once frozen (Python's default: 700)


class HeapFreezer:
    """Freezes the heap as the subscriptions held grow (see the module's docstring)."""

    def __init__(self, least: int = FREEZE_LEAST, growth: float = FREEZE_GROWTH) -> None:
        self._next = least
        self._growth = growth
        self.freezes = 0

    def held(self, subscriptions: int) -> bool:
        """Note the subscriptions held; freeze if they grew enough (True when it froze)."""
        if subscriptions < self._next:
            return False
        t0 = time.process_time()
        gc.unfreeze()  # what was frozen before and died since is collected now
        gc.collect()
        gc.freeze()
        if not self.freezes:
            young, middle, old = gc.get_threshold()
            gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
        self.freezes += 1
        log.info(
            "heap frozen at %d subscriptions (%.2f s of CPU)",
            subscriptions,
            time.process_time() - t0,
        )
        self._next = max(self._next, int(subscriptions * self._growth))
        return True
