"""The store's SQLite memory is bounded by `store_cache_kib`, however large its file grows.

SQLite's page cache keeps every page a connection reads or writes until it is
full, so a store whose file keeps growing (the duplicate windows' ``seen``
rows grow for hours at a steady load) gains resident memory until the cache
reaches its bound: the growth the soak measured (bench/results/soak.md).
These tests write far more than the bound and read SQLite's own memory
counter (``sqlite3_memory_used``, the ``geofed_sqlite_memory_bytes`` gauge):
no timing is involved.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from geofed.node import Store, sqlite_memory_used
from geofed.routing import InvalidInput

_IDENTITY = {"broker_id": "eu", "strategy": "event-geofence", "federation_digest": "d"}
_OVERHEAD = 160 * 1024
"""What a store connection holds besides its page cache: schema, prepared statements."""


def _used() -> int:
    used = sqlite_memory_used()
    assert used is not None, "the sqlite3 library Python links does not export its counter"
    return used


async def _fill(store: Store, rows: int) -> None:
    """`rows` duplicate-window ids and as many outbox messages, acknowledged as they go."""
    data = b"x" * 1100
    for n in range(1, rows + 1):
        store.put_seen("us", "event", f"us-{n * 7919 % rows}", n)
        store.put_outbox(n, "us", "event", f"eu-{n}", data)
        if n > 50:
            store.delete_outbox("us", [("event", f"eu-{n - 50}")])
        if n % 500 == 0:
            await store.commit()
    await store.commit()


def _grow(tmp_path: Path, cache_kib: int, rows: int) -> tuple[int, int]:
    """SQLite's memory gained by opening a store and filling it, and the file's size."""
    before = _used()
    store = Store(str(tmp_path / "data"), "normal", _IDENTITY, cache_kib=cache_kib)
    store.open()

    async def run() -> int:
        try:
            await _fill(store, rows)
            return _used() - before
        finally:
            await store.close()

    gained = asyncio.run(run())
    size = sum(p.stat().st_size for p in (tmp_path / "data").iterdir())
    return gained, size


def test_sqlite_memory_stays_within_the_cache_bound_while_the_file_grows(
    tmp_path: Path,
) -> None:
    gained, size = _grow(tmp_path, 256, 40_000)
    assert size > 8 * 256 * 1024, f"the file ({size} bytes) must outgrow the cache many times"
    assert gained <= 256 * 1024 + _OVERHEAD, f"SQLite gained {gained} bytes"


def test_the_bound_is_the_setting_not_sqlites_default(tmp_path: Path) -> None:
    """The same writes with a 2 MiB cache keep well above the smaller bound: it is the setting."""
    large, _ = _grow(tmp_path, 2048, 40_000)
    assert large > 256 * 1024 + _OVERHEAD + 1024 * 1024, f"SQLite gained {large} bytes"


def test_a_cache_below_one_kib_is_refused_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="store_cache_kib"):
        Store(str(tmp_path), "normal", _IDENTITY, cache_kib=0)
