"""Per-node message history: every event published here, logged for later queries.

A broker logs each event its local clients publish (gRPC and MQTT alike: the
one place is `BrokerServer.publish`) once the publish is acknowledged: topic,
publisher location, event geofence, payload, publish time, event id. Queries
(`HistoryQuery`, defined with its predicate in the routing core) are answered
federation-wide by `BrokerServer.client_history`; this module keeps one
broker's share (docs/design.md §10).

Storage is behind a small synchronous interface, `HistoryBackend`, with two
implementations:

* `SqliteHistory` (default): its own SQLite file ``history.db`` in the node's
  ``data_dir`` (in memory without one), separate from the durable store so
  that retention never competes with the outbox; publisher locations are
  indexed by their z-order (Morton) code under a plain B-tree (`z_order`).
* `PostgisHistory` (``history_dsn=postgresql://...``): a PostgreSQL table with
  a PostGIS point column under a GiST index, for deployments that outgrow one
  file; brokers may share a database (rows are keyed by broker id).

A backend answers *candidates* newest first, narrowed by its indexes (time,
topic prefix, bounding boxes of the query area); `HistoryLog` applies the one
predicate, `HistoryQuery.matches`, so both backends answer exactly alike.

`HistoryLog` runs the backend on one worker thread, as the durable store
does: writes are queued and applied many per transaction (group commit), and
a read runs after every write queued before it, so a query that follows an
acknowledged publish sees it. History never holds up a publish: a write queue
over `QUEUE_BYTES` drops new entries (``geofed_history_dropped_total``).

Retention: an entry older than ``history_retention_s`` is no longer answered
and is deleted by a sweep; when the entries' bytes (`HistoryRecord.size`)
exceed ``history_max_bytes`` the oldest are deleted down to 90 % of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from geofed.routing import (
    GeofedError,
    GeofenceCache,
    HistoryAnswer,
    HistoryQuery,
    HistoryRecord,
    InvalidInput,
    LatLon,
    StorageFailed,
    cut_history,
)
from geofed.wire import PeerGeofenceCache

from ._store import GroupCommit

log = logging.getLogger("geofed.node.history")
T = TypeVar("T")

FILE = "history.db"
"""The SQLite history's file name in ``data_dir``."""
QUEUE_BYTES = 8 << 20
"""Entries waiting to be written, at most (bytes); beyond, new ones are dropped and counted."""
TRIM_TO = 0.9
"""A size trim deletes the oldest entries until they take this share of the limit."""
WRITE_LINGER_S = 0.005
"""How long recorded entries wait for more before they are written (a query or a
delete writes them at once): one transaction for a few events published apart, and
the writer thread kept off the moments right after a publish (its deliveries)."""
_PAGE = 256  # candidates fetched from the backend at a time
_DELETE_CHUNK = 500  # rows deleted per statement

__all__ = [
    "FILE",
    "HistoryAnswer",
    "HistoryBackend",
    "HistoryLog",
    "HistoryQuery",
    "HistoryRecord",
    "PostgisHistory",
    "SqliteHistory",
    "open_backend",
]


class HistoryBackend(Protocol):
    """One broker's history storage. Synchronous: `HistoryLog` calls it from one thread."""

    def open(self) -> tuple[int, int]:
        """Create or open the storage; returns (entries, their bytes)."""

    def add(self, records: Sequence[HistoryRecord]) -> tuple[int, int]:
        """Store entries in one transaction (an event id already stored is skipped).

        Returns:
            (entries added, their bytes).
        """

    def candidates(
        self, query: HistoryQuery, not_before: float | None
    ) -> Generator[HistoryRecord, None, None]:
        """Entries that may answer `query`, newest first (publish time, then id, descending).

        A superset of the answer in that order, never missing one: the time
        interval (and `not_before`, retention), the topic prefix and the
        bounding boxes of the area narrow it; `HistoryQuery.matches` decides.
        """

    def delete(self, event_ids: Sequence[str]) -> list[HistoryRecord]:
        """Remove these entries; returns those that were there."""

    def expire(self, before: float) -> tuple[int, int]:
        """Remove entries published before `before`; returns (entries, bytes) removed."""

    def trim(self, keep_bytes: int) -> tuple[int, int]:
        """Remove the oldest entries until the rest take at most `keep_bytes`."""

    def close(self) -> None:
        """Release the storage."""


# -- SQLite with a z-order column ----------------------------------------------

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS history (
    n INTEGER PRIMARY KEY, event_id TEXT NOT NULL UNIQUE, topic TEXT NOT NULL,
    published_at REAL NOT NULL, origin TEXT NOT NULL, lat REAL NOT NULL, lon REAL NOT NULL,
    geofence TEXT, payload BLOB NOT NULL, size INTEGER NOT NULL, z INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS history_time ON history (published_at, event_id);
CREATE INDEX IF NOT EXISTS history_topic ON history (topic, published_at);
CREATE INDEX IF NOT EXISTS history_z ON history (z);
"""
_COLUMNS = "event_id, topic, payload, published_at, origin, lat, lon, geofence"

Z_BITS = 16
"""Bits per axis of the z-order grid: cells of 360/2**16 degrees of longitude by
180/2**16 of latitude (about 610 m by 305 m at the equator)."""
_Z_SIDE = 1 << Z_BITS
_Z_X = _Z_SIDE / 360.0
_Z_Y = _Z_SIDE / 180.0
_Z_CELLS = 64  # grid cells a query's boxes are covered with, at most (before merging)
# _SPREAD[b]: the 8 bits of b moved to the even bit positions (b0 -> 0, b1 -> 2, ...).
_SPREAD = [sum(((b >> i) & 1) << (2 * i) for i in range(8)) for b in range(256)]


def _grid(lon: float, lat: float) -> tuple[int, int]:
    """The z-order grid column and row of a point (monotone in each coordinate)."""
    x = int((lon + 180.0) * _Z_X)
    y = int((lat + 90.0) * _Z_Y)
    return min(max(x, 0), _Z_SIDE - 1), min(max(y, 0), _Z_SIDE - 1)


def _interleave(x: int, y: int) -> int:
    """The Morton code of a grid cell: the bits of x and y interleaved (x in the even bits)."""
    spread = _SPREAD
    return spread[x & 255] | spread[x >> 8] << 16 | (spread[y & 255] | spread[y >> 8] << 16) << 1


def z_order(lon: float, lat: float) -> int:
    """The z-order (Morton) code of a publisher location, as the SQLite history stores it.

    Every quadtree cell of the grid is one contiguous run of codes, so a box
    is covered by a few ``BETWEEN`` ranges over a plain B-tree index
    (`z_ranges`); inserting a row costs one more index entry, where an
    R*Tree row cost three times the rest of the insert.
    """
    return _interleave(*_grid(lon, lat))


def z_ranges(boxes: Sequence[tuple[float, float, float, float]]) -> list[tuple[int, int]]:
    """Inclusive z-order code ranges holding every point of the boxes (merged, sorted).

    Each box is covered by the quadtree cells of the finest level at which
    it spans at most its share of `_Z_CELLS` cells; the grid position is
    monotone in each coordinate, so a point inside a box lies in one of them.
    """
    per_box = max(4, _Z_CELLS // max(len(boxes), 1))
    ranges: list[tuple[int, int]] = []
    for minx, miny, maxx, maxy in boxes:
        x0, y0 = _grid(minx, miny)
        x1, y1 = _grid(maxx, maxy)
        shift = 0
        while ((x1 >> shift) - (x0 >> shift) + 1) * ((y1 >> shift) - (y0 >> shift) + 1) > per_box:
            shift += 1
        span = 1 << (2 * shift)
        for cx in range(x0 >> shift, (x1 >> shift) + 1):
            for cy in range(y0 >> shift, (y1 >> shift) + 1):
                low = _interleave(cx, cy) << (2 * shift)
                ranges.append((low, low + span - 1))
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for low, high in ranges:
        if merged and low <= merged[-1][1] + 1:
            if high > merged[-1][1]:
                merged[-1] = (merged[-1][0], high)
        else:
            merged.append((low, high))
    return merged


class SqliteHistory:
    """History in SQLite: a table, a time, a topic and a z-order index of publisher locations.

    Args:
        path: the database file, or ":memory:".
        sync: SQLite ``synchronous`` in WAL mode (the node's ``store_sync``).
        geofences: parses stored geofence WKT back (already validated).
    """

    def __init__(self, path: str, sync: str = "normal", geofences: GeofenceCache | None = None):
        self.path = path
        self._sync = sync
        self._geofences = geofences if geofences is not None else PeerGeofenceCache()
        self._db: sqlite3.Connection | None = None

    @property
    def db(self) -> sqlite3.Connection:
        assert self._db is not None, "history closed"
        return self._db

    def open(self) -> tuple[int, int]:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={self._sync.upper()}")
        columns = {row[1] for row in db.execute("PRAGMA table_info(history)")}
        if columns and "z" not in columns:
            self._migrate(db)
        db.executescript(_SQLITE_SCHEMA)
        self._db = db
        count, size = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM history").fetchone()
        return int(count), int(size)

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Bring a file of the R*Tree schema (before the z-order column) to this one, in place.

        One transaction: the column is added and filled from each entry's
        location, and the R*Tree with its triggers is dropped; a failure
        leaves the file as it was.
        """
        (count,) = db.execute("SELECT COUNT(*) FROM history").fetchone()
        log.warning(
            "history %s: migrating %d entries from the R*Tree schema to the z-order index",
            self.path,
            count,
        )
        db.create_function("geofed_z_order", 2, z_order, deterministic=True)
        try:
            with _transaction(db):
                db.execute("ALTER TABLE history ADD COLUMN z INTEGER NOT NULL DEFAULT 0")
                db.execute("UPDATE history SET z = geofed_z_order(lon, lat)")
                db.execute("DROP TRIGGER IF EXISTS history_in")
                db.execute("DROP TRIGGER IF EXISTS history_out")
                db.execute("DROP TABLE IF EXISTS history_where")
        except sqlite3.Error as exc:
            raise InvalidInput(
                "history", f"cannot migrate {self.path} from the R*Tree schema: {exc}"
            ) from None

    def add(self, records: Sequence[HistoryRecord]) -> tuple[int, int]:
        db = self.db
        rows = [(*_values(r), z_order(r.location.lon, r.location.lat)) for r in records]
        with _transaction(db):
            cur = db.executemany(
                "INSERT OR IGNORE INTO history (event_id, topic, published_at, origin, lat, lon,"
                " geofence, payload, size, z) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            added = cur.rowcount
            if added == len(records):
                return added, sum(r.size for r in records)
            # Some ids were stored already (rare: a retry beyond the duplicate window).
            # New rows take the next keys: the `added` largest are this batch's.
            size = db.execute(
                "SELECT COALESCE(SUM(size), 0) FROM history"
                " WHERE n > (SELECT MAX(n) FROM history) - ?",
                (added,),
            ).fetchone()[0]
        return added, int(size)

    def candidates(
        self, query: HistoryQuery, not_before: float | None
    ) -> Generator[HistoryRecord, None, None]:
        where, params = _time_and_topic(query, not_before, "?")
        if query.boxes is not None:
            ranges = z_ranges(query.boxes)
            # A subquery, as the R*Tree's was: the planner then reads the z index
            # for these ranges rather than scanning a topic's entries (10x slower).
            spans = " OR ".join("z BETWEEN ? AND ?" for _ in ranges)
            where.append(f"n IN (SELECT n FROM history WHERE {spans})")
            for low, high in ranges:
                params.extend((low, high))
        sql = f"SELECT {_COLUMNS} FROM history"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY published_at DESC, event_id DESC"
        cur = self.db.execute(sql, params)
        try:
            while rows := cur.fetchmany(_PAGE):
                for row in rows:
                    yield self._record(row)
        finally:
            cur.close()

    def delete(self, event_ids: Sequence[str]) -> list[HistoryRecord]:
        db = self.db
        out: list[HistoryRecord] = []
        with _transaction(db):
            for chunk in _chunks(list(event_ids)):
                marks = ", ".join("?" for _ in chunk)
                rows = db.execute(
                    f"SELECT n, {_COLUMNS} FROM history WHERE event_id IN ({marks})", chunk
                ).fetchall()
                self._delete_rows(db, [row[0] for row in rows])
                out.extend(self._record(row[1:]) for row in rows)
        return out

    def expire(self, before: float) -> tuple[int, int]:
        db = self.db
        with _transaction(db):
            rows = db.execute(
                "SELECT n, size FROM history WHERE published_at < ?", (before,)
            ).fetchall()
            self._delete_rows(db, [n for n, _ in rows])
        return len(rows), sum(size for _, size in rows)

    def trim(self, keep_bytes: int) -> tuple[int, int]:
        db = self.db
        with _transaction(db):
            total = db.execute("SELECT COALESCE(SUM(size), 0) FROM history").fetchone()[0]
            excess = total - keep_bytes
            doomed: list[int] = []
            freed = 0
            if excess > 0:
                for n, size in db.execute(
                    "SELECT n, size FROM history ORDER BY published_at, event_id"
                ):
                    if freed >= excess:
                        break
                    doomed.append(n)
                    freed += size
            self._delete_rows(db, doomed)
        return len(doomed), freed

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @staticmethod
    def _delete_rows(db: sqlite3.Connection, ns: list[int]) -> None:
        for chunk in _chunks(ns):
            marks = ", ".join("?" for _ in chunk)
            db.execute(f"DELETE FROM history WHERE n IN ({marks})", chunk)

    def _record(self, row: Sequence[Any]) -> HistoryRecord:
        return _record(row, self._geofences)


# -- PostgreSQL with PostGIS ---------------------------------------------------

_PG_SCHEMA = """
CREATE EXTENSION IF NOT EXISTS postgis;
CREATE TABLE IF NOT EXISTS geofed_history (
    broker TEXT NOT NULL, event_id TEXT NOT NULL, topic TEXT COLLATE "C" NOT NULL,
    published_at DOUBLE PRECISION NOT NULL, origin TEXT NOT NULL,
    location geometry(Point, 4326) NOT NULL, geofence TEXT, payload BYTEA NOT NULL,
    size INTEGER NOT NULL, PRIMARY KEY (broker, event_id));
CREATE INDEX IF NOT EXISTS geofed_history_time ON geofed_history (broker, published_at);
CREATE INDEX IF NOT EXISTS geofed_history_topic ON geofed_history (broker, topic, published_at);
CREATE INDEX IF NOT EXISTS geofed_history_where ON geofed_history USING GIST (location);
"""
_PG_COLUMNS = (
    "event_id, topic, payload, published_at, origin, ST_Y(location), ST_X(location), geofence"
)


class PostgisHistory:
    """History in a PostgreSQL table with a PostGIS point per entry (GiST-indexed).

    Args:
        dsn: a libpq connection string or ``postgresql://`` URI.
        broker_id: whose entries these are (one table can serve many brokers).
        geofences: parses stored geofence WKT back (already validated).
    """

    def __init__(self, dsn: str, broker_id: str, geofences: GeofenceCache | None = None):
        self.dsn = dsn
        self.broker_id = broker_id
        self._geofences = geofences if geofences is not None else PeerGeofenceCache()
        self._conn: Any = None

    def open(self) -> tuple[int, int]:
        try:
            import psycopg
        except ImportError:
            raise InvalidInput(
                "history_dsn", "the PostgreSQL backend needs psycopg: pip install 'geofed[postgis]'"
            ) from None
        try:
            conn = self._connection()
        except psycopg.Error as exc:
            raise InvalidInput("history_dsn", f"cannot connect: {_pg_reason(exc)}") from None
        with conn.transaction():
            # Two brokers creating the schema at once: one waits for the other.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('geofed_history'))")
            conn.execute(_PG_SCHEMA)
        row = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM geofed_history WHERE broker = %s",
            (self.broker_id,),
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def _connection(self) -> Any:
        """The connection, made again if the server closed it (a restart, say)."""
        import psycopg

        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._conn = conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        return conn

    def add(self, records: Sequence[HistoryRecord]) -> tuple[int, int]:
        conn = self._connection()
        added = size = 0
        with conn.transaction(), conn.cursor() as cur:
            for r in records:
                cur.execute(
                    "INSERT INTO geofed_history VALUES (%(broker)s, %(event_id)s, %(topic)s,"
                    " %(published_at)s, %(origin)s,"
                    " ST_SetSRID(ST_MakePoint(%(lon)s, %(lat)s), 4326), %(geofence)s,"
                    " %(payload)s, %(size)s) ON CONFLICT DO NOTHING",
                    {"broker": self.broker_id, **_row(r)},
                )
                if cur.rowcount:
                    added += 1
                    size += r.size
        return added, size

    def candidates(
        self, query: HistoryQuery, not_before: float | None
    ) -> Generator[HistoryRecord, None, None]:
        where, params = _time_and_topic(query, not_before, "%s")
        where.insert(0, "broker = %s")
        params.insert(0, self.broker_id)
        if query.boxes is not None:
            where.append(
                "("
                + " OR ".join(
                    "location && ST_MakeEnvelope(%s, %s, %s, %s, 4326)" for _ in query.boxes
                )
                + ")"
            )
            for box in query.boxes:
                params.extend(box)
        sql = (
            f"SELECT {_PG_COLUMNS} FROM geofed_history WHERE {' AND '.join(where)}"
            " ORDER BY published_at DESC, event_id DESC"
        )
        conn = self._connection()
        with conn.transaction(), conn.cursor(name="geofed_history_read") as cur:
            cur.itersize = _PAGE
            cur.execute(sql, params)
            for row in cur:
                yield _record(row, self._geofences)

    def delete(self, event_ids: Sequence[str]) -> list[HistoryRecord]:
        conn = self._connection()
        out: list[HistoryRecord] = []
        with conn.transaction():
            for chunk in _chunks(list(event_ids)):
                rows = conn.execute(
                    f"DELETE FROM geofed_history WHERE broker = %s AND event_id = ANY(%s)"
                    f" RETURNING {_PG_COLUMNS}",
                    (self.broker_id, chunk),
                ).fetchall()
                out.extend(_record(row, self._geofences) for row in rows)
        return out

    def expire(self, before: float) -> tuple[int, int]:
        conn = self._connection()
        with conn.transaction():
            row = conn.execute(
                "WITH gone AS (DELETE FROM geofed_history WHERE broker = %s AND published_at < %s"
                " RETURNING size) SELECT COUNT(*), COALESCE(SUM(size), 0) FROM gone",
                (self.broker_id, before),
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def trim(self, keep_bytes: int) -> tuple[int, int]:
        conn = self._connection()
        with conn.transaction():
            # Newest first, a running sum: what lies beyond `keep_bytes` goes.
            row = conn.execute(
                "WITH ranked AS (SELECT event_id, size, SUM(size) OVER (ORDER BY published_at"
                " DESC, event_id DESC) AS running FROM geofed_history WHERE broker = %s),"
                " gone AS (DELETE FROM geofed_history h USING ranked r WHERE h.broker = %s"
                " AND h.event_id = r.event_id AND r.running > %s RETURNING h.size)"
                " SELECT COUNT(*), COALESCE(SUM(size), 0) FROM gone",
                (self.broker_id, self.broker_id, keep_bytes),
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _pg_reason(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# -- shared ------------------------------------------------------------------


def _time_and_topic(
    query: HistoryQuery, not_before: float | None, mark: str
) -> tuple[list[str], list[Any]]:
    """SQL conditions (and their parameters) for the time interval and the topic prefix."""
    where: list[str] = []
    params: list[Any] = []
    start = query.start
    if not_before is not None:
        start = not_before if start is None else max(start, not_before)
    if start is not None:
        where.append(f"published_at >= {mark}")
        params.append(start)
    if query.end is not None:
        where.append(f"published_at <= {mark}")
        params.append(query.end)
    topics = query.topic_range
    if topics is not None:
        low, high = topics
        where.append(f"topic >= {mark}")
        params.append(low)
        if high is not None:
            where.append(f"topic < {mark}")
            params.append(high)
    return where, params


_VALUE_NAMES = (
    "event_id", "topic", "published_at", "origin", "lat", "lon", "geofence", "payload", "size"
)  # fmt: skip


def _values(r: HistoryRecord) -> tuple[Any, ...]:
    """An entry's column values in `_VALUE_NAMES` order (both backends' INSERT)."""
    return (
        r.event_id,
        r.topic,
        r.published_at,
        r.origin,
        r.location.lat,
        r.location.lon,
        None if r.geofence is None else r.geofence.wkt,
        r.payload,
        r.size,
    )


def _row(r: HistoryRecord) -> dict[str, Any]:
    """`_values` by name (the PostGIS INSERT's parameters)."""
    return dict(zip(_VALUE_NAMES, _values(r), strict=True))


def _record(row: Sequence[Any], geofences: GeofenceCache) -> HistoryRecord:
    event_id, topic, payload, published_at, origin, lat, lon, fence = row
    return HistoryRecord(
        event_id,
        topic,
        bytes(payload),
        float(published_at),
        origin,
        LatLon(float(lat), float(lon)),
        None if fence is None else geofences.get(fence, "history.geofence"),
    )


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    db.execute("BEGIN")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _chunks(items: list[T]) -> Iterator[list[T]]:
    for i in range(0, len(items), _DELETE_CHUNK):
        yield items[i : i + _DELETE_CHUNK]


def open_backend(broker_id: str, data_dir: str, dsn: str, sync: str = "normal") -> HistoryBackend:
    """The backend the settings name: PostGIS with a DSN, else SQLite (file or memory)."""
    if dsn:
        if not dsn.startswith(("postgresql://", "postgres://")) and "=" not in dsn:
            raise InvalidInput(
                "history_dsn", "must be a postgresql:// URI or a libpq 'key=value' string"
            )
        return PostgisHistory(dsn, broker_id)
    if data_dir:
        try:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidInput("data_dir", f"cannot create {data_dir}: {exc.strerror}") from None
        return SqliteHistory(str(Path(data_dir) / FILE), sync)
    return SqliteHistory(":memory:", "off")


# -- the asynchronous log --------------------------------------------------------


class HistoryLog:
    """A backend run on one worker thread: queued writes, group commit, retention.

    Args:
        backend: where entries live.
        retention_s: entries older than this are not answered and are swept (0 = kept
            until the size limit removes them).
        max_bytes: most bytes of entries kept (`HistoryRecord.size`); beyond, the oldest go.
        on_change: told (entries, bytes) held after every change, and (reason, n) removals
            through `on_removed` — the node's metrics.
        clock: wall-clock seconds (tests may drive it).
    """

    def __init__(
        self,
        backend: HistoryBackend,
        retention_s: float,
        max_bytes: int,
        *,
        on_change: Callable[[int, int], None] | None = None,
        on_removed: Callable[[str, int], None] | None = None,
        on_dropped: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.entries = 0
        self.bytes = 0
        self._on_change = on_change
        self._on_removed = on_removed
        self._on_dropped = on_dropped
        self._clock = clock
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geofed-history")
        self._writes: GroupCommit[HistoryRecord] = GroupCommit(
            self._exec, self._write, "history", self._written, linger_s=WRITE_LINGER_S
        )
        self._queued_bytes = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._opened = False

    # -- lifecycle -----------------------------------------------------------

    def open(self) -> None:
        """Open the backend (synchronous, before serving) and start the retention sweep."""
        try:
            self.entries, self.bytes = self._exec.submit(self.backend.open).result()
        except GeofedError:
            raise
        except Exception as exc:
            raise InvalidInput("history", f"cannot open the history store: {exc}") from None
        self._opened = True
        self._changed()

    def start_sweeping(self) -> None:
        """Sweep expired entries periodically (call from the event loop)."""
        if self.retention_s and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_forever(), name="history-sweep"
            )

    async def close(self) -> None:
        """Write what is queued, stop sweeping, close the backend."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        with contextlib.suppress(StorageFailed):
            await self.flush()
        if self._opened:
            self._opened = False
            await asyncio.get_running_loop().run_in_executor(self._exec, self.backend.close)
        self._exec.shutdown(wait=True)

    # -- writes ----------------------------------------------------------------

    def record(self, records: Sequence[HistoryRecord]) -> None:
        """Queue entries for writing; never waits (entries over `QUEUE_BYTES` are dropped)."""
        dropped = 0
        for r in records:
            if self._queued_bytes + r.size > QUEUE_BYTES:
                dropped += 1
                continue
            self._writes.write(r)
            self._queued_bytes += r.size
        if dropped:
            log.warning("history: %d entries dropped, the write queue is full", dropped)
            if self._on_dropped is not None:
                self._on_dropped(dropped)

    async def flush(self) -> None:
        """Wait until everything queued so far is written (or its transaction failed).

        Raises:
            StorageFailed: the write failed.
        """
        await self._writes.commit()

    def _written(self, batch: list[HistoryRecord], error: StorageFailed | None) -> None:
        """Event loop, after each batch: it left the queue (and was lost if it failed)."""
        self._queued_bytes -= sum(r.size for r in batch)
        if error is not None and self._on_dropped is not None:
            self._on_dropped(len(batch))
        self._changed()

    def _write(self, batch: list[HistoryRecord]) -> None:
        """Worker thread: add a batch, then keep the size limit."""
        added, size = self.backend.add(batch)
        self.entries += added
        self.bytes += size
        if self.bytes > self.max_bytes:
            try:
                n, freed = self.backend.trim(int(self.max_bytes * TRIM_TO))
            except Exception as exc:  # the batch is in: the next write or sweep trims
                log.error("history trim failed: %s", exc)
            else:
                self._removed("size", n, freed)

    def _removed(self, reason: str, n: int, freed: int) -> None:
        self.entries -= n
        self.bytes -= freed
        if n and self._on_removed is not None:
            self._on_removed(reason, n)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.entries, self.bytes)

    # -- reads and deletes --------------------------------------------------------

    async def query(
        self, query: HistoryQuery, max_bytes: int | None = None
    ) -> tuple[list[HistoryRecord], bool]:
        """This broker's first `query.limit` answers, newest first, and whether bytes cut them.

        Sees every entry recorded before it was called (and not since removed).

        Raises:
            StorageFailed: the backend failed.
        """
        await self.flush()
        not_before = self._not_before()

        def run() -> list[HistoryRecord]:
            out: list[HistoryRecord] = []
            with contextlib.closing(self.backend.candidates(query, not_before)) as found:
                for record in found:
                    if query.matches(record):
                        out.append(record)
                        if len(out) >= query.limit:
                            break
            return out

        found = await self._run(run)
        return cut_history(found, max_bytes)

    async def delete(self, event_ids: Sequence[str]) -> list[HistoryRecord]:
        """Remove these entries; returns those that were there (and not expired)."""
        await self.flush()
        not_before = self._not_before()

        def run() -> list[HistoryRecord]:
            gone = self.backend.delete(event_ids)
            self._removed("delete", len(gone), sum(r.size for r in gone))
            return [r for r in gone if not_before is None or r.published_at >= not_before]

        out = await self._run(run)
        self._changed()
        return out

    async def sweep(self) -> None:
        """Remove what retention no longer keeps (age, then size)."""
        await self.flush()
        not_before = self._not_before()

        def run() -> None:
            if not_before is not None:
                n, freed = self.backend.expire(not_before)
                self._removed("age", n, freed)
            if self.bytes > self.max_bytes:
                n, freed = self.backend.trim(int(self.max_bytes * TRIM_TO))
                self._removed("size", n, freed)

        await self._run(run)
        self._changed()

    def _not_before(self) -> float | None:
        return self._clock() - self.retention_s if self.retention_s else None

    async def _sweep_forever(self) -> None:
        every = min(60.0, max(self.retention_s / 10, 0.05))
        while True:
            await asyncio.sleep(every)
            try:
                await self.sweep()
            except StorageFailed as exc:
                log.error("history sweep failed: %s", exc)

    async def _run(self, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._exec, fn)
        except GeofedError:
            raise
        except Exception as exc:
            raise StorageFailed(f"history: {exc}") from None
