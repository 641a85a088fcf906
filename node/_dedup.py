"""Duplicate windows: the last N message keys a broker took, in memory fixed up front.

A broker drops a message it has already taken: an event id it published (a
client's retry) and, per peer link, an event or delivery the peer sends again
after a reconnect or a restart (docs/design.md §8). Both windows are a
`DedupWindow` of `dedup_window` keys.

A key is a 64-bit digest of (kind, event id), not the id: the window holds
neither the id strings nor tuples of them, so what it costs does not depend on
how long the ids are. The digest is Python's `hash` of the tuple: SipHash-1-3
of the id under a key drawn at process start (unless PYTHONHASHSEED fixes
it), mixed with the kind by the tuple hash, which for a given kind maps the
id's hash one-to-one. Two different (kind, id) pairs get the same digest with
probability about 2**-64, so a new message is taken for a duplicate of one of
the N in a window with probability about N / 2**64: 5.4e-15 for the default
100,000, one false duplicate in ~580 years at 10,000 new messages per second
into one window. A client cannot aim for a collision without the process's
hash key. The key changes at restart, so digests are never stored: the node's
store keeps the ids, and a restart digests them again.

The window is a set of digests and a ring of the same digests in the order
they were added. Both are filled at construction with N placeholders (ints of
the digests' size that no digest can equal), so the set's table, the ring and
the int objects are all allocated before the first message: taking a message
replaces one key by another, and memory stays where it started (about 92
bytes a key as allocated, 100 in resident memory: 10 MiB for 100,000; the
set's table is rebuilt now and then to shed deleted slots, and the first
rebuild leaves the allocator holding one more table, 4 MiB once). The
lookups and updates are the same C set and list operations an ordered dict of
ids used, on a key hashed once.
"""

from __future__ import annotations

_PLACEHOLDER = 1 << 63  # digests are signed 64-bit: placeholders from 2**63 up are none of them
_FORGOTTEN = -1  # `hash` never answers -1: a ring slot whose key was forgotten


class DedupWindow:
    """The (kind, event id) keys among the last `size` added: constant memory, O(1) operations.

    Answers exactly as a deque of the last `size` keys added (a set beside it
    for the lookups) would: `add` puts a new key at the young end and pushes
    the oldest out, and `forget` takes one key out but leaves its place in the
    ring, so a forgotten key shortens the window by one until its place comes
    round. `kind` is a `Kind` (or its value: the same digest).
    """

    __slots__ = ("_keys", "_next", "_ring", "added", "size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a duplicate window holds at least one key, got {size}")
        self.size = size
        self.added = 0  # keys added since construction (the node trims its store copy by it)
        self._ring = [_PLACEHOLDER + i for i in range(size)]
        self._keys = set(self._ring)
        self._next = 0  # the ring slot of the oldest key, which the next add replaces

    def seen(self, kind: str, event_id: str) -> bool:
        """The window holds this key."""
        return hash((kind, event_id)) in self._keys

    def add(self, kind: str, event_id: str) -> bool:
        """Add this key unless the window holds it; answer whether it was new."""
        key = hash((kind, event_id))  # the digest (module docstring)
        keys = self._keys
        if key in keys:
            return False
        keys.add(key)
        i = self._next
        ring = self._ring
        keys.discard(ring[i])
        ring[i] = key
        i += 1
        self._next = 0 if i == self.size else i
        self.added += 1
        return True

    def forget(self, kind: str, event_id: str) -> None:
        """Take this key out (a publish that failed: its retry must go through).

        Searches the ring (C speed, at most `size` slots): for the rare failure
        path only.
        """
        key = hash((kind, event_id))
        if key in self._keys:
            self._keys.discard(key)
            self._ring[self._ring.index(key)] = _FORGOTTEN
