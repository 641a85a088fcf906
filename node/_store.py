"""The node's store: SQLite in WAL mode, written by one thread with group commit.

What a broker must not lose lives here (docs/design.md §8):

* ``outbox`` — every event or delivery message for a peer, written before the
  publish (or the peer frame that caused it) is acknowledged, and deleted when
  the peer acknowledges the frame that carried it. With a store the outbox *is*
  the peer queue; memory only holds a window of it.
* ``sessions``, ``subscriptions`` — persistent sessions and their
  subscriptions, with the last offset the subscriber acknowledged;
* ``pending`` — deliveries of persistent subscriptions not yet acknowledged by
  the subscriber, by offset;
* ``remote`` — the subscriptions peers forwarded, one row per subscription
  and home (each home's copy until it withdraws it), so that a restarted
  broker matches for them before the peers' snapshots arrive;
* ``seen`` — the recent event ids per peer (and of local publishes), the
  duplicate windows, so that a restart does not let a resend through (trimmed
  to the newest window's worth every quarter window: at most 1.25 windows).

Without a data directory the same tables live in an in-memory database: the
node runs one code path, and only the outbox is left out (peer queues are then
memory only, as the config documents).

Every write is queued and applied by a single worker thread, many writes per
transaction (group commit): `commit` waits until everything written before it
is in a committed transaction, or raises `StorageFailed` if that transaction
failed (a full disk, say), in which case none of its writes happened. Reads
(`outbox_page`, `pending_page`) run on the same thread after the writes queued
before them, so they see those writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import importlib.util
import logging
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from geofed.routing import InvalidInput, StorageFailed

from ._config import STORE_CACHE_KIB, SYNC_MODES

log = logging.getLogger("geofed.node.store")
T = TypeVar("T")
W = TypeVar("W")


def _remote_row(sub_id: str, home: str) -> str:
    """The row id of one home's copy of a forwarded subscription (``remote`` table):
    ids hold no control characters, so the separator cannot occur in either part."""
    return f"{sub_id}\x1e{home}"


class GroupCommit(Generic[W]):
    """Writes queued on the event loop, applied by one worker thread many per transaction.

    `commit` waits until everything written before it is applied, or raises
    `StorageFailed` if the transaction holding it failed (`apply` must then
    have applied none of the batch). The durable store and the message
    history (`_history.py`) both write this way.

    Args:
        executor: the single worker thread that owns the database.
        apply: applies one batch in one transaction (on the worker thread).
        what: names the storage in errors and logs (``store /data/geofed.db``).
        after: called on the event loop after each batch with the batch and its
            error (None if it was applied).
        linger_s: how long a batch nobody waits for may wait for more writes
            (a `commit` ends the wait): fewer, larger transactions, and no
            worker thread running right after each write (0: at once).
    """

    def __init__(
        self,
        executor: ThreadPoolExecutor,
        apply: Callable[[list[W]], None],
        what: str,
        after: Callable[[list[W], StorageFailed | None], None] | None = None,
        linger_s: float = 0.0,
    ) -> None:
        self._exec = executor
        self._apply = apply
        self._what = what
        self._after = after
        self._linger_s = linger_s
        self._hurry = asyncio.Event()  # a commit is waiting: stop lingering
        self._batch: list[W] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.failed = ""  # why the last transaction failed ("" once one succeeds again)

    @property
    def dirty(self) -> bool:
        """Writes are queued that no commit has covered yet."""
        return bool(self._batch)

    def write(self, item: W) -> None:
        """Queue one write (applied by the next batch)."""
        self._batch.append(item)
        self._kick()

    async def commit(self) -> None:
        """Wait until every write queued so far is applied.

        Raises:
            StorageFailed: the transaction holding them failed; none of its
                writes happened.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._hurry.set()
        self._kick()
        await fut

    def _kick(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._batch or self._waiters:
            if self._linger_s and not self._waiters:
                self._hurry.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._linger_s):
                        await self._hurry.wait()
            batch, self._batch = self._batch, []
            waiters, self._waiters = self._waiters, []
            error: StorageFailed | None = None
            if batch:
                try:
                    await loop.run_in_executor(self._exec, self._apply, batch)
                except Exception as exc:
                    error = StorageFailed(f"{self._what}: {exc}")
                    if self.failed != str(exc):
                        log.error(
                            "%s: write failed (%d writes lost): %s", self._what, len(batch), exc
                        )
                    self.failed = str(exc)
                else:
                    self.failed = ""
                if self._after is not None:
                    self._after(batch, error)
            for fut in waiters:
                if not fut.done():
                    if error is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(error)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    oid INTEGER PRIMARY KEY, peer TEXT NOT NULL, kind TEXT NOT NULL,
    event_id TEXT NOT NULL, data BLOB NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_key ON outbox (peer, kind, event_id);
CREATE INDEX IF NOT EXISTS outbox_peer ON outbox (peer, oid);
CREATE TABLE IF NOT EXISTS sessions (
    client TEXT PRIMARY KEY, lat REAL NOT NULL, lon REAL NOT NULL, expiry_s REAL NOT NULL,
    owner TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS subscriptions (
    key TEXT PRIMARY KEY, client TEXT NOT NULL, data BLOB NOT NULL, acked INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pending (
    sub TEXT NOT NULL, offset INTEGER NOT NULL, size INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (sub, offset)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS remote (
    id TEXT PRIMARY KEY, home TEXT NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS mqtt_qos (key TEXT PRIMARY KEY, qos INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS mqtt_wills (
    event_id TEXT PRIMARY KEY, client TEXT NOT NULL, due REAL NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS seen (
    peer TEXT NOT NULL, kind TEXT NOT NULL, event_id TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (peer, kind, event_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS seen_order ON seen (peer, n);
"""

_FILE = "geofed.db"


@functools.cache
def _sqlite_memory_used() -> Callable[[], int] | None:
    # The library Python's sqlite3 module is linked with (dlsym on the module's
    # handle searches its dependencies too); None if it does not export it.
    spec = importlib.util.find_spec("_sqlite3")
    try:
        fn = ctypes.CDLL(spec.origin if spec is not None else None).sqlite3_memory_used
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int64
    fn.argtypes = []
    return fn


def sqlite_memory_used() -> int | None:
    """Bytes of memory SQLite holds in this process, or None where it cannot be read.

    SQLite's own counter (``sqlite3_memory_used``): every connection's page
    cache, prepared statements and schema, the store's and the history's
    together. It is what the node's RSS gains as the page caches fill
    (`geofed_sqlite_memory_bytes`).
    """
    fn = _sqlite_memory_used()
    return None if fn is None else int(fn())


@dataclass
class PendingInfo:
    """What the node keeps in memory about one persistent subscription's queue."""

    acked: int = 0  # last offset the subscriber acknowledged
    last: int = 0  # last offset assigned
    count: int = 0  # deliveries stored, not acknowledged
    bytes: int = 0
    trimming: bool = False  # a trim of the oldest is under way


@dataclass
class Loaded:
    """A store's content at start, for the node to rebuild its state from."""

    sessions: list[tuple[str, float, float, float, str]] = field(default_factory=list)
    subscriptions: list[tuple[str, str, bytes]] = field(default_factory=list)  # key, client, pb
    pending: dict[str, PendingInfo] = field(default_factory=dict)
    remote: list[tuple[str, bytes]] = field(default_factory=list)  # home, RemoteSubscription pb
    seen: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # peer -> (kind, id)
    outbox: dict[str, int] = field(default_factory=dict)  # peer -> messages waiting
    next_oid: int = 1
    next_seen: int = 1
    strategy_state: str = ""  # BrokerState.transition_state as JSON ("" before any change)


class Store:
    """One broker's SQLite store (see the module docstring).

    Args:
        data_dir: directory of the database file; "" keeps it in memory.
        sync: `SYNC_MODES`: ``normal`` (a commit survives the process being
            killed, not a power loss), ``full`` (fsync at every commit) or
            ``off``.
        identity: broker id, strategy and federation digest. A data directory
            written under another identity is refused: its subscriptions and
            queues would be wrong here.
        max_bytes: most bytes the database may grow to (0: no limit); a
            transaction that would grow it further fails (`StorageFailed`).
        cache_kib: SQLite's page cache for this connection, in KiB. The cache
            keeps every page it reads or writes until it is full, so it grows
            with the file (the duplicate windows' ``seen`` rows take hours to
            reach their 1.25 windows) up to this bound and then stays there.
            An in-memory store (no `data_dir`) keeps all its pages regardless.
    """

    def __init__(
        self,
        data_dir: str,
        sync: str,
        identity: dict[str, str],
        max_bytes: int = 0,
        cache_kib: int = STORE_CACHE_KIB,
    ) -> None:
        if sync not in SYNC_MODES:
            raise InvalidInput("store_sync", f"one of {', '.join(SYNC_MODES)}, got {sync!r}")
        self.durable = bool(data_dir)
        if self.durable:
            try:
                Path(data_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InvalidInput(
                    "data_dir", f"cannot create {data_dir}: {exc.strerror}"
                ) from None
            self.path = str(Path(data_dir) / _FILE)
        else:
            self.path = ":memory:"
        self._sync = sync
        self._identity = identity
        self._max_bytes = max_bytes
        if cache_kib < 1:
            raise InvalidInput("store_cache_kib", f"must be >= 1, got {cache_kib!r}")
        self._cache_kib = cache_kib
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geofed-store")
        self._db: sqlite3.Connection | None = None
        self._writes: GroupCommit[tuple[str, Sequence[Any]]] = GroupCommit(
            self._exec, self._apply, f"store {self.path}"
        )

    # -- opening -----------------------------------------------------------

    def open(self) -> Loaded:
        """Open (or create) the database and read it: synchronous, before serving."""
        return self._exec.submit(self._open).result()

    def _open(self) -> Loaded:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self._sync.upper()}")
            db.execute(f"PRAGMA cache_size=-{self._cache_kib}")  # negative: KiB, not pages
            db.executescript(_SCHEMA)
            if self._max_bytes:
                page = db.execute("PRAGMA page_size").fetchone()[0]
                db.execute(f"PRAGMA max_page_count={max(1, self._max_bytes // page)}")
        except sqlite3.Error as exc:
            raise InvalidInput("data_dir", f"cannot open store {self.path}: {exc}") from None
        self._db = db
        for key, value in self._identity.items():
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES (?, ?)", (key, value))
            elif row[0] != value:
                raise InvalidInput(
                    "data_dir",
                    f"{self.path} holds the state of {key} {row[0]!r}, this node has {value!r};"
                    " use another data_dir (or delete this one to start empty)",
                )
        out = Loaded()
        out.sessions = db.execute(
            "SELECT client, lat, lon, expiry_s, owner FROM sessions"
        ).fetchall()
        out.subscriptions = db.execute("SELECT key, client, data FROM subscriptions").fetchall()
        for key, acked in db.execute("SELECT key, acked FROM subscriptions"):
            out.pending[key] = PendingInfo(acked=acked, last=acked)
        for sub, last, count, size in db.execute(
            "SELECT sub, MAX(offset), COUNT(*), SUM(size) FROM pending GROUP BY sub"
        ):
            info = out.pending.get(sub)
            if info is not None:
                info.last, info.count, info.bytes = max(info.last, last), count, size
        out.remote = db.execute("SELECT home, data FROM remote").fetchall()
        for peer, kind, event_id in db.execute("SELECT peer, kind, event_id FROM seen ORDER BY n"):
            out.seen.setdefault(peer, []).append((kind, event_id))
        out.outbox = dict(db.execute("SELECT peer, COUNT(*) FROM outbox GROUP BY peer").fetchall())
        out.next_oid = (db.execute("SELECT MAX(oid) FROM outbox").fetchone()[0] or 0) + 1
        out.next_seen = (db.execute("SELECT MAX(n) FROM seen").fetchone()[0] or 0) + 1
        row = db.execute("SELECT value FROM meta WHERE key = 'strategy_state'").fetchone()
        out.strategy_state = row[0] if row is not None else ""
        return out

    async def close(self) -> None:
        """Write what is queued, then close the database."""
        with contextlib.suppress(StorageFailed):
            await self.commit()
        db, self._db = self._db, None
        if db is not None:
            await asyncio.get_running_loop().run_in_executor(self._exec, db.close)
        self._exec.shutdown(wait=True)

    # -- writes (queued; see `commit`) --------------------------------------

    def put_strategy_state(self, value: str) -> None:
        """Keep the node's strategy tables and transition phase (docs/design.md §3)."""
        self._write("INSERT OR REPLACE INTO meta VALUES ('strategy_state', ?)", (value,))

    def put_outbox(self, oid: int, peer: str, kind: str, event_id: str, data: bytes) -> None:
        self._write(
            "INSERT OR IGNORE INTO outbox VALUES (?, ?, ?, ?, ?)", (oid, peer, kind, event_id, data)
        )

    def delete_outbox(self, peer: str, keys: list[tuple[str, str]]) -> None:
        """Forget messages `peer` acknowledged (by kind and event id)."""
        for kind, event_id in keys:
            self._write(
                "DELETE FROM outbox WHERE peer = ? AND kind = ? AND event_id = ?",
                (peer, kind, event_id),
            )

    def put_session(self, client: str, lat: float, lon: float, expiry_s: float, owner: str) -> None:
        self._write(
            "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?)",
            (client, lat, lon, expiry_s, owner),
        )

    def delete_session(self, client: str) -> None:
        """Forget a session with its subscriptions and their queued deliveries."""
        self._write(
            "DELETE FROM pending WHERE sub IN (SELECT key FROM subscriptions WHERE client = ?)",
            (client,),
        )
        self._write("DELETE FROM subscriptions WHERE client = ?", (client,))
        self._write("DELETE FROM sessions WHERE client = ?", (client,))

    def put_subscription(self, key: str, client: str, data: bytes, acked: int) -> None:
        self._write(
            "INSERT OR REPLACE INTO subscriptions VALUES (?, ?, ?, ?)", (key, client, data, acked)
        )

    def delete_subscription(self, key: str) -> None:
        self._write("DELETE FROM pending WHERE sub = ?", (key,))
        self._write("DELETE FROM subscriptions WHERE key = ?", (key,))
        self._write("DELETE FROM mqtt_qos WHERE key = ?", (key,))

    def put_mqtt_qos(self, key: str, qos: int) -> None:
        """The QoS granted to a persistent subscription made over MQTT (gone with it)."""
        self._write("INSERT OR REPLACE INTO mqtt_qos VALUES (?, ?)", (key, qos))

    async def mqtt_qos(self) -> dict[str, int]:
        """The QoS kept for each persistent MQTT subscription, by subscription key."""
        return dict(await self._read("SELECT key, qos FROM mqtt_qos", ()))

    def put_mqtt_will(self, event_id: str, client: str, due: float, data: bytes) -> None:
        """An MQTT will waiting out its Will Delay Interval: its event, due at `due` (epoch s)."""
        self._write(
            "INSERT OR REPLACE INTO mqtt_wills VALUES (?, ?, ?, ?)", (event_id, client, due, data)
        )

    def delete_mqtt_will(self, event_id: str) -> None:
        """The will was published or dropped."""
        self._write("DELETE FROM mqtt_wills WHERE event_id = ?", (event_id,))

    async def mqtt_wills(self) -> list[tuple[str, float, bytes]]:
        """The delayed wills kept: (client, due, encoded event), the earliest due first."""
        return list(await self._read("SELECT client, due, data FROM mqtt_wills ORDER BY due", ()))

    def put_pending(self, key: str, offset: int, data: bytes) -> None:
        self._write(
            "INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?)", (key, offset, len(data), data)
        )

    def ack_pending(self, key: str, offset: int) -> None:
        """The subscriber processed everything up to `offset`."""
        self._write("DELETE FROM pending WHERE sub = ? AND offset <= ?", (key, offset))
        self._write(
            "UPDATE subscriptions SET acked = ? WHERE key = ? AND acked < ?", (offset, key, offset)
        )

    def put_remote(self, sub_id: str, home: str, data: bytes) -> None:
        """Keep `home`'s copy of a forwarded subscription (replacing that home's older one)."""
        row = (_remote_row(sub_id, home), home, data)
        self._write("INSERT OR REPLACE INTO remote VALUES (?, ?, ?)", row)

    def delete_remote(self, sub_id: str, home: str) -> None:
        """Forget `home`'s copy of a forwarded subscription."""
        # Stores written before copies were kept per home have rows by id alone.
        self._write(
            "DELETE FROM remote WHERE id IN (?, ?) AND home = ?",
            (_remote_row(sub_id, home), sub_id, home),
        )

    def clear_remote(self, home: str) -> None:
        self._write("DELETE FROM remote WHERE home = ?", (home,))

    def put_seen(self, peer: str, kind: str, event_id: str, n: int) -> None:
        self._write("INSERT OR REPLACE INTO seen VALUES (?, ?, ?, ?)", (peer, kind, event_id, n))

    def trim_seen(self, peer: str, keep: int) -> None:
        """Keep only the newest `keep` ids `peer`'s duplicate window added."""
        self._write(
            "DELETE FROM seen WHERE peer = ? AND n <"
            " (SELECT n FROM seen WHERE peer = ? ORDER BY n DESC LIMIT 1 OFFSET ?)",
            (peer, peer, keep - 1),
        )

    # -- commit and reads -------------------------------------------------

    @property
    def dirty(self) -> bool:
        """Writes are queued that no commit has covered yet."""
        return self._writes.dirty

    @property
    def failed(self) -> str:
        """Why the last transaction failed ("" once one succeeds again)."""
        return self._writes.failed

    async def commit(self) -> None:
        """Wait until every write queued so far is committed.

        Raises:
            StorageFailed: the transaction holding them failed; none of its
                writes happened.
        """
        await self._writes.commit()

    async def outbox_page(
        self, peer: str, from_oid: int, limit: int
    ) -> list[tuple[int, str, bytes]]:
        """Up to `limit` outbox messages for `peer` from `from_oid` on, in order."""
        await self.commit()
        return await self._read(
            "SELECT oid, kind, data FROM outbox WHERE peer = ? AND oid >= ? ORDER BY oid LIMIT ?",
            (peer, from_oid, limit),
        )

    async def pending_page(self, key: str, after: int, limit: int) -> list[tuple[int, bytes]]:
        """Up to `limit` queued deliveries of a subscription after offset `after`, in order."""
        await self.commit()
        return await self._read(
            "SELECT offset, data FROM pending WHERE sub = ? AND offset > ? ORDER BY offset LIMIT ?",
            (key, after, limit),
        )

    async def drop_oldest(self, key: str, budget: int) -> tuple[int, int, int]:
        """Delete a subscription's oldest deliveries until the rest fit in `budget` bytes.

        Returns:
            (deliveries deleted, their bytes, the last offset deleted).
        """
        await self.commit()

        def run(db: sqlite3.Connection) -> tuple[int, int, int]:
            total = db.execute("SELECT COALESCE(SUM(size), 0) FROM pending WHERE sub = ?", (key,))
            excess = total.fetchone()[0] - budget
            n = size = last = 0
            for offset, row_size in db.execute(
                "SELECT offset, size FROM pending WHERE sub = ? ORDER BY offset", (key,)
            ):
                if size >= excess:
                    break
                n, size, last = n + 1, size + row_size, offset
            if n:
                db.execute("DELETE FROM pending WHERE sub = ? AND offset <= ?", (key, last))
            return n, size, last

        return await self._run(run)

    async def ack(self, key: str, offset: int) -> tuple[int, int]:
        """The subscriber processed everything up to `offset`: forget it.

        Returns:
            (deliveries forgotten, their bytes).
        """
        await self.commit()

        def run(db: sqlite3.Connection) -> tuple[int, int]:
            n, size = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM pending"
                " WHERE sub = ? AND offset <= ?",
                (key, offset),
            ).fetchone()
            db.execute("BEGIN")
            db.execute("DELETE FROM pending WHERE sub = ? AND offset <= ?", (key, offset))
            db.execute(
                "UPDATE subscriptions SET acked = ? WHERE key = ? AND acked < ?",
                (offset, key, offset),
            )
            db.execute("COMMIT")
            return int(n), int(size)

        return await self._run(run)

    async def drop_pending(self, key: str, offsets: Sequence[int]) -> tuple[int, int]:
        """Delete these queued deliveries of a subscription (those still there).

        Returns:
            (deliveries deleted, their bytes).
        """
        await self.commit()

        def run(db: sqlite3.Connection) -> tuple[int, int]:
            n = size = 0
            db.execute("BEGIN")
            try:
                for offset in offsets:
                    row = db.execute(
                        "DELETE FROM pending WHERE sub = ? AND offset = ? RETURNING size",
                        (key, offset),
                    ).fetchone()
                    if row is not None:
                        n, size = n + 1, size + row[0]
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return n, size

        return await self._run(run)

    async def _read(self, sql: str, params: Sequence[Any]) -> list[Any]:
        return await self._run(lambda db: db.execute(sql, params).fetchall())

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            assert self._db is not None, "store closed"
            return fn(self._db)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._exec, call)
        except sqlite3.Error as exc:
            raise StorageFailed(f"store {self.path}: {exc}") from None

    # -- group commit ------------------------------------------------------

    def _write(self, sql: str, params: Sequence[Any]) -> None:
        self._writes.write((sql, params))

    def _apply(self, batch: list[tuple[str, Sequence[Any]]]) -> None:
        db = self._db
        if db is None:
            raise sqlite3.ProgrammingError("store closed")
        db.execute("BEGIN")
        try:
            for sql, params in batch:
                db.execute(sql, params)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
