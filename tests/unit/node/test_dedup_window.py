"""The duplicate window (node/_dedup.py): answers like a set+deque window, memory fixed up front."""

from __future__ import annotations

import tracemalloc
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.node._dedup import DedupWindow
from geofed.routing import Kind

Key = tuple[str, str]  # (kind, event id)


class ReferenceWindow:
    """The plain reading of 'the last `size` keys added': a deque of them and a set beside it.

    A forgotten key leaves a hole (None) in its place in the deque.
    """

    def __init__(self, size: int) -> None:
        self.ring: deque[Key | None] = deque(maxlen=size)
        self.keys: set[Key] = set()

    def seen(self, kind: str, event_id: str) -> bool:
        return (kind, event_id) in self.keys

    def add(self, kind: str, event_id: str) -> bool:
        key = (kind, event_id)
        if key in self.keys:
            return False
        if len(self.ring) == self.ring.maxlen:
            self.keys.discard(self.ring[0])  # type: ignore[arg-type]
        self.ring.append(key)
        self.keys.add(key)
        return True

    def forget(self, kind: str, event_id: str) -> None:
        key = (kind, event_id)
        if key in self.keys:
            self.keys.discard(key)
            self.ring[self.ring.index(key)] = None


IDS = [f"e{i}" for i in range(12)]  # few ids: adds repeat and evicted ids come back
KINDS = [Kind.EVENT, Kind.DELIVERY]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "forget", "in"]), st.sampled_from(KINDS), st.sampled_from(IDS)
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 9), ops=OPS)
def test_answers_exactly_like_a_set_and_deque_window(
    size: int, ops: list[tuple[str, Kind, str]]
) -> None:
    window, reference = DedupWindow(size), ReferenceWindow(size)
    added = 0
    for op, kind, event_id in ops:
        if op == "add":
            new = reference.add(kind, event_id)
            assert window.add(kind, event_id) == new
            added += new
        elif op == "forget":
            window.forget(kind, event_id)
            reference.forget(kind, event_id)
        # After every step, every key answers the same: eviction order included.
        assert [window.seen(k, i) for k in KINDS for i in IDS] == [
            reference.seen(k, i) for k in KINDS for i in IDS
        ]
    assert window.added == added


def test_added_counts_new_keys_only() -> None:
    window = DedupWindow(2)
    assert window.add(Kind.EVENT, "a")
    assert not window.add(Kind.EVENT, "a")
    assert window.add(Kind.EVENT, "b")
    assert window.add(Kind.EVENT, "c")  # pushes a out
    assert window.add(Kind.EVENT, "a")  # new again
    assert window.added == 4


def test_a_forgotten_key_added_again_outlives_its_old_place() -> None:
    """The hole a forgotten key leaves, when its turn comes, does not take the key's new copy."""
    window = DedupWindow(3)
    e = Kind.EVENT
    window.add(e, "a")
    window.forget(e, "a")
    window.add(e, "b")
    window.add(e, "a")  # the publish is retried: a again, now the youngest
    assert window.seen(e, "a")
    window.add(e, "c")  # the hole where a was goes out: a stays
    assert (window.seen(e, "a"), window.seen(e, "b"), window.seen(e, "c")) == (True, True, True)
    window.add(e, "d")  # now b goes
    assert (window.seen(e, "a"), window.seen(e, "b")) == (True, False)


def test_no_digest_collides_among_many_ids_of_both_kinds() -> None:
    """64-bit digests (the hash of the (kind, id) tuple, node/_dedup.py): among 400,000 keys
    a collision has probability ~4e-9; none is a placeholder or the forgotten mark."""
    ids = [f"run-{i:07d}" for i in range(200_000)]
    keys = {hash((k, i)) for k in (Kind.EVENT, Kind.DELIVERY) for i in ids}
    assert len(keys) == 2 * len(ids)
    assert all(-(1 << 63) <= k < 1 << 63 and k != -1 for k in keys)


def test_memory_is_allocated_up_front() -> None:
    """Filling the window and turning it over three times allocates nothing that stays."""
    size = 100_000  # the default dedup_window
    ids = [f"publisher-7-{i:08d}" for i in range(3 * size)]
    tracemalloc.start()
    try:
        window = DedupWindow(size)
        built = tracemalloc.get_traced_memory()[0]
        for event_id in ids:
            window.add(Kind.EVENT, event_id)
        turned = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert built > 88 * size  # the set's table, the ring and the placeholder ints
    assert turned <= built
