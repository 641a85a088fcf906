"""The store's forwarded subscriptions: one row per subscription and home."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from geofed.node import Store

_IDENTITY = {"broker_id": "eu", "strategy": "subscription-geofence", "federation_digest": "d"}


def _reopen(tmp_path: Path, *writes: tuple[str, str, str, bytes]) -> list[tuple[str, bytes]]:
    """Apply `writes` ("put"/"delete"/"clear", id, home, data) to the store, reopen it and
    return its forwarded subscriptions (home, data), sorted."""
    store = Store(str(tmp_path / "data"), "normal", _IDENTITY)
    store.open()

    async def run() -> None:
        try:
            for op, sub_id, home, data in writes:
                if op == "put":
                    store.put_remote(sub_id, home, data)
                elif op == "delete":
                    store.delete_remote(sub_id, home)
                else:
                    store.clear_remote(home)
            await store.commit()
        finally:
            await store.close()

    asyncio.run(run())
    again = Store(str(tmp_path / "data"), "normal", _IDENTITY)
    loaded = again.open()
    asyncio.run(again.close())
    return sorted(loaded.remote)


def test_each_homes_copy_is_kept_and_withdrawn_on_its_own(tmp_path: Path) -> None:
    # A subscriber that moved us -> ap: both homes' copies are held until each
    # withdraws its own; a newer version from the same home replaces its copy.
    rows = _reopen(
        tmp_path,
        ("put", "c1\x1fs1", "us", b"us v1"),
        ("put", "c1\x1fs1", "ap", b"ap v2"),
        ("put", "c1\x1fs1", "us", b"us v3"),
    )
    assert rows == [("ap", b"ap v2"), ("us", b"us v3")]
    rows = _reopen(tmp_path, ("delete", "c1\x1fs1", "ap", b""))
    assert rows == [("us", b"us v3")]
    rows = _reopen(tmp_path, ("put", "c2\x1fs1", "ap", b"ap"), ("clear", "", "us", b""))
    assert rows == [("ap", b"ap")]


def test_a_row_written_by_id_alone_is_withdrawn_too(tmp_path: Path) -> None:
    # Stores written before copies were kept per home have one row per subscription.
    _reopen(tmp_path)
    db = sqlite3.connect(next((tmp_path / "data").glob("*.db")))
    with db:
        db.execute("INSERT INTO remote VALUES (?, ?, ?)", ("c1\x1fs1", "us", b"old"))
    db.close()
    assert _reopen(tmp_path) == [("us", b"old")]
    assert _reopen(tmp_path, ("delete", "c1\x1fs1", "us", b"")) == []
