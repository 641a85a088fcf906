"""Tests for the workload generator: trace contract, distributions, files and CLI."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import shapely

from geofed.bench import SCENARIOS, WorkloadConfig, generate, read_trace_file, workload, write_trace
from geofed.routing import (
    InvalidInput,
    LatLon,
    TraceOp,
    great_circle_m,
    op_to_record,
    read_trace,
    validate_filter,
    validate_topic,
)

TOKYO = LatLon(35.6895, 139.69171)
REYKJAVIK = LatLon(64.13548, -21.89541)
EUROPE = (-10.0, 35.0, 30.0, 60.0)
# Circle vertices lie on the radius up to floating-point error of the geodesic
# formulas (haversine vs. destination point): far below a millimetre.
REL_TOL = 1e-6


def records(ops: list[TraceOp]) -> list[dict[str, Any]]:
    return [op_to_record(op) for op in ops]


def binomial_ok(hits: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    """`hits` of `n` is within `sigmas` standard deviations of a share `p`."""
    return abs(hits - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def fence_distances(op: TraceOp) -> tuple[float, float]:
    """Smallest and largest distance of the op's geofence vertices from its location."""
    assert op.geofence is not None and op.location is not None
    coords = shapely.get_coordinates(op.geofence.geometry)
    # Vertices added where a circle is cut at ±180 lie inside it; the original
    # 64 vertices all lie on the circle.
    dists = [great_circle_m(op.location, LatLon(lat, lon)) for lon, lat in coords]
    return min(dists), max(dists)


# --------------------------------------------------------------------------
# Every scenario: one trace each, written as JSON Lines and re-read (validated).


@pytest.fixture(scope="module", params=SCENARIOS)
def trace(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[WorkloadConfig, list[TraceOp], list[TraceOp]]:
    cfg = WorkloadConfig(
        scenario=request.param,
        clients=80,
        duration_s=40.0,
        publish_rate_hz=0.5,
        unsubscribe_share=0.5,
        move_interval_s=2.0,
        wildcard_share=0.5,
        seed=7,
    )
    generated = list(generate(cfg))
    path = tmp_path_factory.mktemp("trace") / f"{request.param}.jsonl"
    write_trace(generated, path)
    with path.open(encoding="utf-8") as lines:
        parsed = list(read_trace(lines))  # validates every line, geofences included
    return cfg, generated, parsed


def test_file_holds_exactly_the_generated_ops_as_compact_json(trace: Any, tmp_path: Path) -> None:
    _, generated, parsed = trace
    assert records(parsed) == records(generated)
    path = tmp_path / "again.jsonl"
    write_trace(generated, path)
    for line, rec in zip(path.read_text().splitlines(), records(generated), strict=True):
        assert line == json.dumps(rec, separators=(",", ":"))


def test_times_are_ordered_within_the_duration(trace: Any) -> None:
    cfg, ops, _ = trace
    times = [op.t for op in ops]
    assert times == sorted(times)
    assert times[0] >= 0.0 and times[-1] <= cfg.duration_s


def test_ids_are_unique_and_subscriptions_end_after_they_start(trace: Any) -> None:
    cfg, ops, _ = trace
    event_ids = [op.id for op in ops if op.op == "publish"]
    assert len(set(event_ids)) == len(event_ids)
    assert all(re.fullmatch(r"e[1-9]\d*", i) for i in event_ids)
    clients = {op.client for op in ops}
    assert all(re.fullmatch(r"c[1-9]\d*", c) and int(c[1:]) <= cfg.clients for c in clients)
    started: dict[str, tuple[str, float]] = {}
    ended: set[str] = set()
    for op in ops:
        if op.op == "subscribe":
            assert re.fullmatch(r"s[1-9]\d*", op.id) and op.id not in started
            started[op.id] = (op.client, op.t)
        elif op.op == "unsubscribe":
            assert op.id in started and op.id not in ended
            assert started[op.id][0] == op.client and started[op.id][1] <= op.t
            ended.add(op.id)
    assert started and ended  # unsubscribe_share=0.5: some end, some do not
    assert len(ended) < len(started)


def test_every_op_but_unsubscribe_carries_the_current_location(trace: Any) -> None:
    cfg, ops, _ = trace
    where: dict[str, LatLon] = {}
    for op in ops:
        if op.op == "unsubscribe":
            assert op.location is None
            continue
        assert op.location is not None
        # Locations change only by a move: between fixes a client stays where it
        # last reported, and stationary clients never move at all.
        if op.op != "move" and op.client in where:
            assert op.location == where[op.client]
        where[op.client] = op.location
    moves = [op for op in ops if op.op == "move"]
    assert bool(moves) == (cfg.scenario in ("mobile", "global", "mixed"))
    if cfg.scenario == "mixed":  # only the app users move
        movers = {op.client for op in moves}
        still = {op.client for op in ops if op.op == "publish" or op.topic.startswith("telemetry/")}
        assert movers and not movers & still


def test_geofences_are_circles_of_1_to_100_km_around_the_client(trace: Any) -> None:
    cfg, ops, _ = trace
    if cfg.scenario == "mixed":
        return  # its own shapes: test_mixed_topics_have_their_own_shapes
    fenced = Counter(op.op for op in ops if op.geofence is not None)
    world = Counter(op.op for op in ops if op.geofence is None and op.op != "move")
    expect = {
        "context": {"publish"},
        "open-data": {"subscribe"},
        "mobile": {"publish", "subscribe"},
        "global": {"publish", "subscribe"},
    }[cfg.scenario]
    assert set(fenced) == expect
    assert world["unsubscribe"] == sum(op.op == "unsubscribe" for op in ops)
    for op in ops:
        if op.geofence is None:
            continue
        low, high = fence_distances(op)
        assert cfg.radius_min_m * (1 - REL_TOL) <= high <= cfg.radius_max_m * (1 + REL_TOL)
        assert low >= high * 0.99  # a circle (cut only at ±180), centred on the client


def test_topics_are_valid_and_some_filters_use_wildcards(trace: Any) -> None:
    _, ops, _ = trace
    subs = [op for op in ops if op.op == "subscribe"]
    for op in ops:
        if op.op == "publish":
            validate_topic(op.topic)
            assert re.fullmatch(
                r"sensors/[a-z]{2}/[a-z0-9-]+/[a-z-]+|telemetry/[a-z]{2}/[a-z0-9-]+/[a-z-]+"
                r"|alerts/[a-z]{2}/[a-z-]+",
                op.topic,
            )
        elif op.op == "subscribe":
            validate_filter(op.topic)
    wild = [op for op in subs if "+" in op.topic or "#" in op.topic]
    assert 0 < len(wild) < len(subs)


# --------------------------------------------------------------------------
# The mixed scenario


@pytest.fixture(scope="module")
def mixed() -> tuple[WorkloadConfig, list[TraceOp]]:
    cfg = WorkloadConfig(scenario="mixed", clients=100, duration_s=120.0, seed=1)
    return cfg, list(generate(cfg))


def test_mixed_topics_have_their_own_shapes(mixed: Any) -> None:
    cfg, ops = mixed
    telemetry = [op for op in ops if op.op == "publish" and op.topic.startswith("telemetry/")]
    alerts = [op for op in ops if op.op == "publish" and op.topic.startswith("alerts/")]
    # 35 sensors at 1 event/s against 10 issuers at 0.5: alerts are rare.
    assert abs(len(telemetry) - 35 * 120) <= 4 * math.sqrt(35 * 120)
    assert abs(len(alerts) - 10 * 0.5 * 120) <= 4 * math.sqrt(10 * 0.5 * 120)
    assert all(op.geofence is None for op in telemetry)
    fenced = [op for op in alerts if op.geofence is not None]
    assert len(fenced) >= len(alerts) // 2
    for op in fenced:
        low, high = fence_distances(op)
        assert 300_000 * (1 - REL_TOL) <= high <= 2_000_000 * (1 + REL_TOL)
        assert low >= high * 0.99
    consumers = [op for op in ops if op.op == "subscribe" and op.topic.startswith("telemetry/")]
    assert len(consumers) == 10 * cfg.subscriptions_per_subscriber
    for op in consumers:
        assert re.fullmatch(r"telemetry/[a-z]{2}/([a-z0-9-]+|\+)/[a-z-]+", op.topic)
        if op.geofence is not None:
            assert cfg.radius_min_m * (1 - REL_TOL) <= fence_distances(op)[1]
            assert fence_distances(op)[1] <= cfg.radius_max_m * (1 + REL_TOL)
    app = [op for op in ops if op.op == "subscribe" and op.topic == "alerts/#"]
    assert app and all(op.geofence is None for op in app)
    assert len(consumers) + len(app) == sum(op.op == "subscribe" for op in ops)


def test_mixed_app_users_are_online_most_in_the_middle(mixed: Any) -> None:
    cfg, ops = mixed
    assert workload.activity(0.0, 120.0) == pytest.approx(0.02)
    assert workload.activity(60.0, 120.0) == pytest.approx(1.0)
    online: set[str] = set()
    samples: dict[int, int] = {}
    fifth = cfg.duration_s / 5
    for op in ops:
        samples.setdefault(int(op.t // fifth), len(online))
        if op.op == "subscribe" and op.topic == "alerts/#":
            online.add(op.id)
        elif op.op == "unsubscribe":
            online.discard(op.id)
    # Sessions start mostly in the middle of the trace and last an eighth of it.
    assert samples[2] > 3 * max(1, samples[0])
    assert samples[0] <= 5


def test_mixed_makes_each_static_strategy_wrong_for_a_topic(mixed: Any) -> None:
    from geofed.routing import Federation, federation_path, predict

    _, ops = mixed
    fed = Federation.load(federation_path("aws-2020"))

    def only(prefix: str) -> list[TraceOp]:
        ids = {op.id for op in ops if op.op == "subscribe" and op.topic.startswith(prefix)}
        return [op for op in ops if op.op == "move" or op.topic.startswith(prefix) or op.id in ids]

    cost = {
        (prefix, name): predict(fed, name, only(prefix)).total_messages
        for prefix in ("telemetry/", "alerts/")
        for name in ("event-geofence", "subscription-geofence")
    }
    assert cost["telemetry/", "subscription-geofence"] * 20 < cost["telemetry/", "event-geofence"]
    assert cost["alerts/", "event-geofence"] * 1.5 < cost["alerts/", "subscription-geofence"]


# --------------------------------------------------------------------------
# Distributions


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    cfg = WorkloadConfig(scenario="mobile", clients=30, duration_s=20.0, seed=3)
    first = records(list(generate(cfg)))
    assert first == records(list(generate(cfg)))
    other = records(list(generate(WorkloadConfig(scenario="mobile", clients=30, duration_s=20.0))))
    assert first != other


def test_speeds_lie_between_walking_and_driving() -> None:
    cfg = WorkloadConfig(scenario="mobile", clients=60, duration_s=60.0, publish_rate_hz=0.1)
    last: dict[str, TraceOp] = {}
    speeds = []
    for op in generate(cfg):
        if op.op != "move":
            continue
        prev = last.get(op.client)
        if prev is not None:
            assert prev.location is not None and op.location is not None
            assert op.t - prev.t == pytest.approx(cfg.move_interval_s, abs=1e-5)
            speeds.append(great_circle_m(prev.location, op.location) / (op.t - prev.t))
        last[op.client] = op
    assert len(speeds) > 300
    assert min(speeds) >= 1.4 * (1 - 1e-4) and max(speeds) <= 30.0 * (1 + 1e-4)
    # Uniform over clients: both slow and fast clients occur.
    assert min(speeds) < 8.0 and max(speeds) > 22.0


@pytest.mark.parametrize(
    ("scenario", "share", "kinds"),
    [
        ("context", None, {"publish"}),  # default 0.1
        ("open-data", 0.25, {"subscribe"}),
        ("mobile", 0.5, {"publish", "subscribe"}),
        ("global", None, {"publish", "subscribe"}),  # default 0.3
    ],
)
def test_world_share_is_near_the_configured_value(
    scenario: str, share: float | None, kinds: set[str]
) -> None:
    cfg = WorkloadConfig(
        scenario=scenario,
        clients=500,
        duration_s=20.0,
        publish_rate_hz=0.3,
        subscriptions_per_subscriber=4,
        world_share=share,
        move_interval_s=20.0,
    )
    ops = [op for op in generate(cfg) if op.op in kinds]
    world = sum(op.geofence is None for op in ops)
    assert len(ops) > 800
    assert binomial_ok(world, len(ops), cfg.effective_world_share)


def test_world_share_defaults_per_scenario() -> None:
    assert WorkloadConfig(scenario="global").effective_world_share == 0.3
    for scenario in ("context", "open-data", "mobile"):
        assert WorkloadConfig(scenario=scenario).effective_world_share == 0.1
    assert WorkloadConfig(scenario="global", world_share=0.0).effective_world_share == 0.0
    no_world = WorkloadConfig(scenario="mobile", clients=20, duration_s=10.0, world_share=0.0)
    assert all(op.geofence is not None for op in generate(no_world) if op.op == "publish")


def test_clients_concentrate_in_populous_cities() -> None:
    # Subscribers only, without geofences: cheap, and every client appears.
    cfg = WorkloadConfig(clients=3000, publisher_share=0.0, subscriptions_per_subscriber=1)
    homes = {op.client: op.location for op in generate(cfg) if op.op == "subscribe"}
    assert len(homes) == 3000

    def near(city: LatLon) -> int:
        return sum(great_circle_m(city, loc) <= 50_000 for loc in homes.values() if loc)

    # Greater Tokyo (~20 M in cities >= 100k of ~2.9 G) expects ~20 of 3000;
    # Reykjavik (~0.12 M) expects 0.1.
    assert near(TOKYO) >= 8
    assert near(TOKYO) > 5 * max(1, near(REYKJAVIK))


def test_bbox_places_every_client_inside() -> None:
    cfg = WorkloadConfig(clients=200, publisher_share=0.0, bbox=EUROPE)
    west, south, east, north = EUROPE
    locs = [op.location for op in generate(cfg) if op.location is not None]
    assert len(locs) >= 200
    assert all(west <= p.lon <= east and south <= p.lat <= north for p in locs)


def test_bbox_across_the_antimeridian() -> None:
    # New Zealand and Fiji side: west > east.
    cfg = WorkloadConfig(clients=50, publisher_share=0.0, bbox=(160.0, -50.0, -170.0, -30.0))
    locs = [op.location for op in generate(cfg) if op.location is not None]
    assert locs and all((p.lon >= 160.0 or p.lon <= -170.0) and -50 <= p.lat <= -30 for p in locs)


def test_bbox_without_cities_is_rejected_naming_bbox() -> None:
    with pytest.raises(InvalidInput, match=r"^bbox: no city"):
        generate(WorkloadConfig(bbox=(-150.0, -40.0, -140.0, -30.0)))  # open Pacific


def test_payload_sizes_and_publish_rate() -> None:
    cfg = WorkloadConfig(
        scenario="open-data",
        clients=100,
        duration_s=30.0,
        publish_rate_hz=2.0,
        payload_bytes=300,
        payload_sigma=1.0,
        payload_max_bytes=2000,
    )
    sizes = [op.payload_size for op in generate(cfg) if op.op == "publish"]
    expected = 50 * 2.0 * 30.0  # publishers * rate * duration, Poisson
    assert abs(len(sizes) - expected) <= 4 * math.sqrt(expected)
    assert min(sizes) >= 1 and max(sizes) == 2000  # sigma 1 reaches the cap
    assert 250 <= statistics.median(sizes) <= 360
    fixed = WorkloadConfig(scenario="open-data", clients=10, duration_s=10.0, payload_sigma=0.0)
    assert {op.payload_size for op in generate(fixed) if op.op == "publish"} == {256}


@pytest.mark.parametrize(("share", "ended"), [(0.0, 0.0), (1.0, 1.0)])
def test_unsubscribe_share_bounds(share: float, ended: float) -> None:
    cfg = WorkloadConfig(clients=40, unsubscribe_share=share, subscriptions_per_subscriber=3)
    ops = Counter(op.op for op in generate(cfg))
    assert ops["subscribe"] == 20 * 3
    assert ops["unsubscribe"] == ops["subscribe"] * ended


@pytest.mark.parametrize(("share", "wild"), [(0.0, False), (1.0, True)])
def test_wildcard_share_bounds(share: float, wild: bool) -> None:
    cfg = WorkloadConfig(clients=40, wildcard_share=share, publisher_share=0.0)
    filters = [op.topic for op in generate(cfg) if op.op == "subscribe"]
    assert filters and all(("+" in f or "#" in f) == wild for f in filters)


# --------------------------------------------------------------------------
# Files


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_roaming_share_gives_roaming_circles_that_round_trip(tmp_path: Path, suffix: str) -> None:
    cfg = WorkloadConfig(scenario="open-data", clients=40, publisher_share=0.0, roaming_share=0.5)
    generated = list(generate(cfg))
    subs = [op for op in generated if op.op == "subscribe"]
    roaming = [op for op in subs if op.roaming is not None]
    assert 0 < len(roaming) < len(subs)
    assert all(op.geofence is None and op.roaming.radius_m for op in roaming)  # type: ignore[union-attr]
    # Without a roaming share the same seed gives the same trace as before it existed.
    plain = list(generate(WorkloadConfig(scenario="open-data", clients=40, publisher_share=0.0)))
    assert [op.t for op in plain] == [op.t for op in generated]
    path = tmp_path / f"trace{suffix}"
    write_trace(generated, path)
    back = list(read_trace_file(path))
    assert [op.roaming for op in back] == [op.roaming for op in generated]


def test_parquet_round_trip(tmp_path: Path) -> None:
    cfg = WorkloadConfig(scenario="mobile", clients=30, duration_s=20.0, unsubscribe_share=0.5)
    generated = list(generate(cfg))
    path = tmp_path / "trace.parquet"
    summary = write_trace(generated, path)
    assert pq.read_schema(path).names == [
        "t",
        "op",
        "client",
        "lat",
        "lon",
        "id",
        "topic",
        "geofence",
        "payload_size",
        "roaming",
    ]
    assert records(list(read_trace_file(path))) == records(generated)
    assert sum(summary.ops.values()) == len(generated)
    assert summary.clients == len({op.client for op in generated})
    assert (summary.t_first, summary.t_last) == (generated[0].t, generated[-1].t)


def test_read_trace_file_reports_bad_parquet_rows(tmp_path: Path) -> None:
    import pyarrow as pa

    table = pa.table(
        {
            "t": [1.0, 0.5],
            "op": ["move", "move"],
            "client": ["c1", "c1"],
            "lat": [1.0, 1.0],
            "lon": [2.0, 2.0],
        }
    )
    pq.write_table(table, tmp_path / "back.parquet")
    with pytest.raises(InvalidInput, match=r"^line 2: t"):
        list(read_trace_file(tmp_path / "back.parquet"))


# --------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scenario", "rush-hour"),
        ("clients", 0),
        ("clients", 2.5),
        ("clients", True),
        ("duration_s", 0.0),
        ("duration_s", math.inf),
        ("seed", "7"),
        ("publisher_share", 1.5),
        ("subscriptions_per_subscriber", -1),
        ("unsubscribe_share", -0.1),
        ("publish_rate_hz", -1.0),
        ("publish_rate_hz", math.nan),
        ("topics_per_publisher", 0),
        ("kinds", ()),
        ("kinds", ("a/b",)),
        ("kinds", ("noise", "noise")),
        ("wildcard_share", 2.0),
        ("payload_bytes", 0),
        ("payload_sigma", -0.5),
        ("payload_max_bytes", 10),
        ("world_share", 1.01),
        ("radius_min_m", 0.0),
        ("radius_max_m", 500.0),
        ("radius_max_m", 6_000_000.0),
        ("speed_min_mps", -1.0),
        ("speed_max_mps", 1.0),
        ("move_interval_s", 0.0),
        ("min_population", 1000),
        ("jitter_m", -5.0),
        ("bbox", (0.0, 0.0, 10.0)),
        ("bbox", (0.0, 50.0, 10.0, 40.0)),
        ("bbox", (0.0, 0.0, 200.0, 10.0)),
        ("bbox", (5.0, 0.0, 5.0, 10.0)),
    ],
)
def test_bad_config_values_raise_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        WorkloadConfig(**{field: value})


# --------------------------------------------------------------------------
# Command line


def workload_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geofed")
    sub = parser.add_subparsers(dest="command", required=True)
    workload.register(sub, "workload")
    return parser


def test_cli_writes_the_trace_and_a_one_line_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w.jsonl"
    flags = "--clients 20 --duration 15 --seed 5 --world-share 0.5 --rate 0.5"
    flags += " --bbox -10 35 30 60 --kinds noise,traffic"
    args = workload_parser().parse_args(["workload", "global", "-o", str(out), *flags.split()])
    assert args.func(args) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1
    assert re.fullmatch(
        rf"{re.escape(str(out))}: global, \d+ ops \(move \d+, subscribe \d+, publish \d+, "
        r"unsubscribe \d+\), 20 clients, t [\d.e-]+\.\.[\d.]+ s",
        summary[0],
    ), summary[0]
    expected = WorkloadConfig(
        scenario="global",
        clients=20,
        duration_s=15.0,
        seed=5,
        world_share=0.5,
        publish_rate_hz=0.5,
        bbox=EUROPE,
        kinds=("noise", "traffic"),
    )
    assert workload.config_from_args(args) == expected
    assert out.read_text().splitlines() == [
        json.dumps(r, separators=(",", ":")) for r in records(list(generate(expected)))
    ]


def test_cli_writes_to_stdout_with_summary_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    args = workload_parser().parse_args(["workload", "open-data", "-o", "-", "--clients", "5"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    ops = list(read_trace(captured.out.splitlines()))
    assert ops and "5 clients" in captured.err


def test_cli_rejects_bad_values_naming_the_field(tmp_path: Path) -> None:
    args = workload_parser().parse_args(
        ["workload", "context", "-o", str(tmp_path / "x.jsonl"), "--clients", "0"]
    )
    with pytest.raises(InvalidInput, match=r"^clients: "):
        args.func(args)
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(SystemExit):
        workload_parser().parse_args(["workload", "context", "-o", "x", "--bbox", "1", "2", "3"])


def test_geofed_main_runs_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cli = importlib.import_module("geofed.cli")
    assert cli.SUBCOMMANDS["workload"] == "geofed.bench.workload"
    # Other subcommands' modules may not exist yet; main() dispatches the same way.
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"workload": "geofed.bench.workload"})
    out = tmp_path / "m.parquet"
    assert cli.main(["workload", "context", "-o", str(out), "--clients", "10"]) == 0
    assert list(read_trace_file(out))
    assert "10 clients" in capsys.readouterr().out
    assert cli.main(["workload", "context", "-o", str(out), "--clients", "0"]) == 2
    assert "geofed workload: error: clients: must be >= 1" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    unwritable = str(tmp_path / "a-file" / "dir.jsonl")  # its folder would be a file
    assert cli.main(["workload", "context", "-o", unwritable, "--clients", "3"]) == 2
    fresh = tmp_path / "new" / "folder" / "w.jsonl"  # a missing folder is made
    assert cli.main(["workload", "context", "-o", str(fresh), "--clients", "3"]) == 0


def test_generate_is_lazy() -> None:
    # A trace of ~30 years: only lazy generation returns its first ops at all.
    ops = generate(WorkloadConfig(clients=50, duration_s=1e9))
    first = list(itertools.islice(ops, 10))
    assert [op.t for op in first] == sorted(op.t for op in first)
