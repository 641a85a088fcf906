"""The history store behind its interface, against SQLite and a real PostgreSQL/PostGIS.

Every test runs on both backends: the answers are held against an independent
oracle (the reference topic matcher, shapely's own point-in-polygon with ±180
as one meridian, a plain sort), and retention is checked to keep the store
bounded by age and by size.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shapely.geometry import MultiPolygon, Point, Polygon, box

from geofed.node._history import (
    TRIM_TO,
    HistoryBackend,
    HistoryLog,
    HistoryQuery,
    HistoryRecord,
    PostgisHistory,
    SqliteHistory,
    z_order,
    z_ranges,
)
from geofed.routing import LatLon, parse_geofence, reference_topic_match

BACKENDS = ["sqlite", "postgis"]
TOPICS = ["a", "a/b", "a/c", "a/b/c", "b/x", "$SYS/a", "a//b", "é/ü"]
FILTERS = ["#", "a", "a/#", "a/+", "+/+", "a/+/c", "$SYS/#", "+/a", "é/#", "a//b", "b/x"]


@pytest.fixture(params=BACKENDS)
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], HistoryBackend]:
    """A factory: the backend under test for a broker id (same id = same stored entries)."""
    if request.param == "sqlite":
        return lambda broker: SqliteHistory(str(tmp_path / f"{broker}.db"))
    dsn = request.getfixturevalue("postgres_dsn")
    return lambda broker: PostgisHistory(dsn, broker)


def fresh_id() -> str:
    return "b-" + uuid.uuid4().hex[:12]


def rec(
    i: int,
    topic: str = "a/b",
    t: float = 1000.0,
    lat: float = 0.0,
    lon: float = 0.0,
    payload: bytes = b"p",
    fence: str | None = None,
) -> HistoryRecord:
    return HistoryRecord(
        f"e{i:05d}",
        topic,
        payload,
        t,
        "b1",
        LatLon(lat, lon),
        None if fence is None else parse_geofence(fence),
    )


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def with_log(
    backend: HistoryBackend,
    body: Callable[[HistoryLog], object],
    *,
    retention_s: float = 0.0,
    max_bytes: int = 1 << 30,
    clock: Callable[[], float] | None = None,
) -> object:
    log = HistoryLog(backend, retention_s, max_bytes, **({} if clock is None else {"clock": clock}))
    log.open()
    try:
        return await body(log)  # type: ignore[misc]
    finally:
        await log.close()


def oracle(records: list[HistoryRecord], q: HistoryQuery) -> list[str]:
    """Independent: the reference topic matcher, shapely covers (±180 one meridian), a sort."""

    def inside(r: HistoryRecord) -> bool:
        if q.geometry is None:
            return True
        lon, lat = r.location.lon, r.location.lat
        lons = [lon, -lon] if abs(lon) == 180.0 else [lon]
        return any(q.geometry.covers(Point(x, lat)) for x in lons)

    hits = [
        r
        for r in records
        if reference_topic_match(q.topic_filter, r.topic)
        and (q.start is None or r.published_at >= q.start)
        and (q.end is None or r.published_at <= q.end)
        and inside(r)
    ]
    hits.sort(key=lambda r: (r.published_at, r.event_id), reverse=True)
    return [r.event_id for r in hits[: q.limit]]


def test_written_entries_come_back_whole(make_backend: Callable[[str], HistoryBackend]) -> None:
    fence = "POLYGON((0 0, 10 0, 10 10, 0 10, 0 0))"
    r = rec(1, "sensors/x", 1234.5, 48.85, 2.35, b"\x00\xffbinary", fence)

    async def body(log: HistoryLog) -> None:
        log.record([r])
        (got,), truncated = await log.query(HistoryQuery("#", None, None, None, 10))
        assert not truncated
        assert (got.event_id, got.topic, got.payload, got.published_at, got.origin) == (
            r.event_id,
            r.topic,
            r.payload,
            r.published_at,
            r.origin,
        )
        assert got.location == r.location
        assert got.geofence is not None and got.geofence.geometry.equals(r.geofence.geometry)
        feature = got.to_geojson_feature()
        assert feature["geometry"] == {"type": "Point", "coordinates": [2.35, 48.85]}
        assert feature["properties"]["payload_encoding"] == "base64"
        assert feature["properties"]["geofence"]["type"] == "Polygon"
        assert log.entries == 1 and log.bytes == r.size

    run(with_log(make_backend(fresh_id()), body))


locations = st.tuples(
    st.sampled_from([-90.0, -45.5, 0.0, 10.0, 45.5, 90.0]),
    st.sampled_from([-180.0, -179.5, -10.0, 0.0, 5.0, 10.0, 179.5, 180.0]),
)
records_st = st.lists(
    st.tuples(st.sampled_from(TOPICS), st.integers(0, 20), locations), min_size=0, max_size=40
)
shapes = st.one_of(
    st.none(),
    st.builds(
        lambda x, y, w, h: box(x, y, min(x + w, 180.0), min(y + h, 90.0)),
        st.sampled_from([-180.0, -20.0, -10.0, 0.0, 5.0, 170.0]),
        st.sampled_from([-90.0, -50.0, 0.0, 10.0]),
        st.sampled_from([5.0, 10.0, 15.5, 360.0]),
        st.sampled_from([10.0, 45.5, 180.0]),
    ),
    st.just(MultiPolygon([box(170, -10, 180, 50), box(-180, -10, -170, 50)])),
    st.just(Polygon([(-20, -20), (20, -20), (0, 30), (-20, -20)])),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=records_st,
    topic_filter=st.sampled_from(FILTERS),
    start=st.one_of(st.none(), st.integers(0, 20)),
    span=st.one_of(st.none(), st.integers(0, 20)),
    geometry=shapes,
    limit=st.integers(1, 50),
)
def test_answers_equal_the_oracle(
    make_backend: Callable[[str], HistoryBackend],
    data: list[tuple[str, int, tuple[float, float]]],
    topic_filter: str,
    start: int | None,
    span: int | None,
    geometry: Polygon | None,
    limit: int,
) -> None:
    records = [rec(i, topic, float(t), lat, lon) for i, (topic, t, (lat, lon)) in enumerate(data)]
    end = None if span is None else (start or 0) + span
    q = HistoryQuery(topic_filter, start, end, geometry, limit)

    async def body(log: HistoryLog) -> list[str]:
        log.record(records)
        found, _ = await log.query(q)
        return [r.event_id for r in found]

    assert run(with_log(make_backend(fresh_id()), body)) == oracle(records, q)


def test_delete_returns_what_it_removed_and_they_are_gone(
    make_backend: Callable[[str], HistoryBackend],
) -> None:
    records = [rec(i, "a/b" if i % 2 else "a/c", 1000.0 + i) for i in range(10)]

    async def body(log: HistoryLog) -> None:
        log.record(records)
        wanted, _ = await log.query(HistoryQuery("a/b", None, None, None, 3))
        gone = await log.delete([r.event_id for r in wanted] + ["no-such-id"])
        assert sorted(r.event_id for r in gone) == sorted(r.event_id for r in wanted)
        assert [r.payload for r in gone] == [b"p"] * 3
        rest, _ = await log.query(HistoryQuery("#", None, None, None, 100))
        assert {r.event_id for r in rest} == {r.event_id for r in records} - {
            r.event_id for r in gone
        }
        assert log.entries == 7 and log.bytes == sum(r.size for r in rest)
        assert await log.delete([r.event_id for r in wanted]) == []

    run(with_log(make_backend(fresh_id()), body))


def test_an_event_id_is_stored_once(make_backend: Callable[[str], HistoryBackend]) -> None:
    async def body(log: HistoryLog) -> None:
        log.record([rec(1, t=1.0), rec(1, t=2.0)])
        found, _ = await log.query(HistoryQuery("#", None, None, None, 10))
        assert [r.published_at for r in found] == [1.0]
        assert log.entries == 1 and log.bytes == rec(1).size
        log.record([rec(2), rec(1), rec(3, payload=b"longer")])  # one known among new ones
        await log.flush()
        assert (
            log.entries == 3
            and log.bytes == rec(1).size + rec(2).size + rec(3, payload=b"longer").size
        )

    run(with_log(make_backend(fresh_id()), body))


def test_entries_survive_reopening(make_backend: Callable[[str], HistoryBackend]) -> None:
    broker = fresh_id()
    records = [rec(i, t=float(i)) for i in range(5)]

    async def write(log: HistoryLog) -> None:
        log.record(records)

    async def read(log: HistoryLog) -> list[str]:
        assert log.entries == 5 and log.bytes == sum(r.size for r in records)
        found, _ = await log.query(HistoryQuery("#", None, None, None, 10))
        return [r.event_id for r in found]

    run(with_log(make_backend(broker), write))
    assert run(with_log(make_backend(broker), read)) == [r.event_id for r in records[::-1]]


def test_answers_are_cut_by_bytes_and_marked(make_backend: Callable[[str], HistoryBackend]) -> None:
    records = [rec(i, t=float(i), payload=b"x" * 100) for i in range(10)]
    size = records[0].size

    async def body(log: HistoryLog) -> None:
        log.record(records)
        found, truncated = await log.query(HistoryQuery("#", None, None, None, 10), 3 * size + 1)
        assert truncated and [r.event_id for r in found] == ["e00009", "e00008", "e00007"]

    run(with_log(make_backend(fresh_id()), body))


def test_retention_by_age(make_backend: Callable[[str], HistoryBackend]) -> None:
    now = [1000.0]
    records = [rec(i, t=900.0 + 10 * i) for i in range(10)]  # 900 ... 990

    async def body(log: HistoryLog) -> None:
        log.record(records)
        everything = HistoryQuery("#", None, None, None, 100)
        found, _ = await log.query(everything)
        assert len(found) == 5  # published at 950 or later: within 50 s of 1000
        assert log.entries == 10  # not swept yet, but no longer answered
        await log.sweep()
        assert log.entries == 5 and log.bytes == sum(r.size for r in records[5:])
        now[0] = 2000.0
        await log.sweep()
        assert log.entries == 0 and log.bytes == 0
        assert (await log.query(everything))[0] == []

    run(with_log(make_backend(fresh_id()), body, retention_s=50.0, clock=lambda: now[0]))


def test_retention_by_size_keeps_the_newest_within_the_limit(
    make_backend: Callable[[str], HistoryBackend],
) -> None:
    size = rec(0, payload=b"x" * 500).size
    limit = 20 * size

    async def body(log: HistoryLog) -> None:
        for batch in range(10):
            log.record(
                [
                    rec(batch * 10 + i, t=float(batch * 10 + i), payload=b"x" * 500)
                    for i in range(10)
                ]
            )
            await log.flush()
            assert log.bytes <= limit
        found, _ = await log.query(HistoryQuery("#", None, None, None, 1000))
        # The newest survive: trimmed down to 90 % of the limit whenever it was passed.
        assert [r.event_id for r in found] == [f"e{i:05d}" for i in range(99, 99 - len(found), -1)]
        assert int(limit * TRIM_TO) - size < len(found) * size <= limit
        assert log.bytes == len(found) * size and log.entries == len(found)

    run(with_log(make_backend(fresh_id()), body, max_bytes=limit))


def test_sqlite_file_stays_bounded(tmp_path: Path) -> None:
    """The files stop growing: pages freed by retention are used again."""
    path = tmp_path / "h.db"
    wal = Path(str(path) + "-wal")
    payload = b"y" * 2000
    limit = 400 * rec(0, payload=payload).size
    sizes: list[tuple[int, int]] = []

    async def body(log: HistoryLog) -> None:
        n = 0
        for _ in range(8):
            for _ in range(5):
                log.record([rec(n + i, t=float(n + i), payload=payload) for i in range(100)])
                n += 100
            await log.flush()
            sizes.append((path.stat().st_size, wal.stat().st_size))
            assert log.bytes <= limit

    run(with_log(SqliteHistory(str(path)), body, max_bytes=limit))
    # Each round writes 500 entries into a store that keeps at most 400 (a
    # million bytes written per round): after the first rounds neither the
    # database nor its write-ahead log grows.
    db_sizes = [db for db, _ in sizes]
    wal_sizes = [w for _, w in sizes]
    assert max(db_sizes[3:]) <= db_sizes[2] * 1.1, sizes
    assert max(wal_sizes[3:]) <= wal_sizes[2] * 1.1, sizes
    assert db_sizes[-1] <= 4 * limit, sizes


lons = st.floats(-180.0, 180.0)
lats = st.floats(-90.0, 90.0)


@settings(max_examples=300, deadline=None)
@given(
    boxes=st.lists(st.tuples(lons, lats, lons, lats), min_size=1, max_size=40),
    where=st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)), min_size=1, max_size=5),
)
def test_z_ranges_hold_every_point_of_the_boxes(
    boxes: list[tuple[float, float, float, float]], where: list[tuple[float, float]]
) -> None:
    """The SQLite index's superset: a point in (or on the edge of) a box has a code in a range."""
    boxes = [(min(a, c), min(b, d), max(a, c), max(b, d)) for a, b, c, d in boxes]
    ranges = z_ranges(boxes)
    assert all(low <= high for low, high in ranges)
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(ranges))  # merged
    assert len(ranges) <= 4 * len(boxes) + 64
    for minx, miny, maxx, maxy in boxes:
        corners = [(minx, miny), (minx, maxy), (maxx, miny), (maxx, maxy)]
        inside = [(minx + u * (maxx - minx), miny + v * (maxy - miny)) for u, v in where]
        for lon, lat in corners + inside:
            lon, lat = min(max(lon, minx), maxx), min(max(lat, miny), maxy)  # rounding
            z = z_order(lon, lat)
            assert any(low <= z <= high for low, high in ranges), (lon, lat, z)


# The SQLite history's schema before the z-order column (publisher locations in an R*Tree).
_RTREE_SCHEMA = """
CREATE TABLE history (
    n INTEGER PRIMARY KEY, event_id TEXT NOT NULL UNIQUE, topic TEXT NOT NULL,
    published_at REAL NOT NULL, origin TEXT NOT NULL, lat REAL NOT NULL, lon REAL NOT NULL,
    geofence TEXT, payload BLOB NOT NULL, size INTEGER NOT NULL);
CREATE INDEX history_time ON history (published_at, event_id);
CREATE INDEX history_topic ON history (topic, published_at);
CREATE VIRTUAL TABLE history_where USING rtree (n, minx, maxx, miny, maxy);
CREATE TRIGGER history_in AFTER INSERT ON history BEGIN
    INSERT INTO history_where VALUES (new.n, new.lon, new.lon, new.lat, new.lat); END;
CREATE TRIGGER history_out AFTER DELETE ON history BEGIN
    DELETE FROM history_where WHERE n = old.n; END;
"""


def test_a_file_of_the_rtree_schema_is_migrated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries written under the old schema are kept, answered by area, and deletable."""
    path = tmp_path / "history.db"
    records = [
        rec(i, t=float(i), lat=lat, lon=lon)
        for i, (lat, lon) in enumerate([(48.85, 2.35), (52.52, 13.4), (-33.87, 151.21), (0, 180)])
    ]
    old = sqlite3.connect(path)
    old.executescript(_RTREE_SCHEMA)
    old.executemany(
        "INSERT INTO history (event_id, topic, published_at, origin, lat, lon, geofence,"
        " payload, size) VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?)",
        [
            (r.event_id, r.topic, r.published_at, r.origin, r.location.lat, r.location.lon, *row)
            for r in records
            for row in [(r.payload, r.size)]
        ],
    )
    old.commit()
    old.close()
    europe = HistoryQuery("#", None, None, box(-10, 35, 30, 60), 10)
    seam = HistoryQuery("#", None, None, box(-180, -10, -170, 10), 10)

    async def body(log: HistoryLog) -> tuple[list[str], list[str], list[str]]:
        assert log.entries == 4 and log.bytes == sum(r.size for r in records)
        log.record([rec(9, t=9.0, lat=45.0, lon=5.0)])
        found, _ = await log.query(europe)
        on_seam, _ = await log.query(seam)
        gone = await log.delete(["e00000"])
        ids = [[r.event_id for r in some] for some in (found, on_seam, gone)]
        return ids[0], ids[1], ids[2]

    with caplog.at_level("WARNING", logger="geofed.node.history"):
        found, on_seam, gone = run(with_log(SqliteHistory(str(path)), body))  # type: ignore[misc]
    assert found == ["e00009", "e00001", "e00000"]
    assert on_seam == ["e00003"]
    assert gone == ["e00000"]
    assert [m for m in caplog.messages if str(path) in m and "migrating 4 entries" in m]
    db = sqlite3.connect(path)
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    db.close()
    assert "history_where" not in tables and "history_z" in tables
    # Opened again: nothing left to migrate, the entries are all there.
    caplog.clear()
    with caplog.at_level("WARNING", logger="geofed.node.history"):
        assert run(with_log(SqliteHistory(str(path)), _entries)) == 4
    assert not caplog.messages


async def _entries(log: HistoryLog) -> int:
    return log.entries


def test_query_validation_names_the_field() -> None:
    from geofed.routing import InvalidInput

    cases = {
        "topic_filter": lambda: HistoryQuery("a/#/b", None, None, None, 1),
        "start": lambda: HistoryQuery("#", float("nan"), None, None, 1),
        "end": lambda: HistoryQuery("#", 10.0, 5.0, None, 1),
        "limit": lambda: HistoryQuery("#", None, None, None, 0),
        "geometry": lambda: HistoryQuery("#", None, None, box(170, 0, 190, 10), 1),
    }
    for name, make in cases.items():
        with pytest.raises(InvalidInput) as err:
            make()
        assert err.value.field == name


def test_candidates_are_streamed_in_order(make_backend: Callable[[str], HistoryBackend]) -> None:
    """A backend's candidates come newest first and a consumer may stop early."""
    backend = make_backend(fresh_id())
    backend.open()
    try:
        backend.add([rec(i, t=float(i % 7)) for i in range(700)])
        it: Iterator[HistoryRecord] = backend.candidates(
            HistoryQuery("#", None, None, None, 5), None
        )
        first = [next(it) for _ in range(10)]
        it.close()  # type: ignore[attr-defined]
        keys = [(r.published_at, r.event_id) for r in first]
        assert keys == sorted(keys, reverse=True) and keys[0][0] == 6.0
        assert backend.delete(["e00000"])[0].event_id == "e00000"
    finally:
        backend.close()


def test_postgis_reconnects_after_the_server_dropped_it(postgres_dsn: str) -> None:
    """A connection the server ended (a restart) costs at most the request that found it
    broken (`StorageFailed`); the next one connects again."""
    import psycopg

    from geofed.routing import StorageFailed

    async def body(log: HistoryLog) -> None:
        log.record([rec(1)])
        await log.flush()
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE pid <> pg_backend_pid() AND datname = current_database()"
                " AND backend_type = 'client backend'"
            )
        q = HistoryQuery("#", None, None, None, 10)
        try:
            found, _ = await log.query(q)
        except StorageFailed:
            found, _ = await log.query(q)
        assert [r.event_id for r in found] == ["e00001"]

    run(with_log(PostgisHistory(postgres_dsn, fresh_id()), body))


def test_postgis_refuses_a_bad_dsn_naming_the_setting() -> None:
    from geofed.node._history import open_backend
    from geofed.routing import InvalidInput

    with pytest.raises(InvalidInput) as err:
        PostgisHistory("postgresql://nobody@127.0.0.1:1/none", "b").open()
    assert err.value.field == "history_dsn"
    with pytest.raises(InvalidInput) as err:
        open_backend("b", "", "mysql://x")
    assert err.value.field == "history_dsn"


def test_an_area_of_many_parts_is_answered(make_backend: Callable[[str], HistoryBackend]) -> None:
    """Thousands of parts (within the vertex limit) ask the index for one box, not thousands."""
    xs = [-179.9 + 0.299 * k for k in range(1200)]
    parts = MultiPolygon([box(x, 0, x + 0.1, 0.1) for x in xs])  # 6,000 vertices
    records = [rec(k, lat=0.05, lon=x + (0.2 if k % 2 else 0.05)) for k, x in enumerate(xs)]
    q = HistoryQuery("#", None, None, parts, 1000)

    async def body(log: HistoryLog) -> list[str]:
        log.record(records)
        found, _ = await log.query(q)
        return [r.event_id for r in found]

    assert run(with_log(make_backend(fresh_id()), body)) == oracle(records, q)
    assert len(oracle(records, q)) == 600
