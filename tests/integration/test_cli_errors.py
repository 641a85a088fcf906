"""Ordinary mistakes on the command line: one line naming the argument, an exit code, no traceback.

Exit codes (``geofed --help``): 2 bad usage or input, 3 broker unavailable,
1 internal error. Each row is a mistake a user made on an earlier version
(which answered with a Python traceback, or silently did something else).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from geofed.bench import LocalFederation, WorkloadConfig, generate, write_trace

pytestmark = pytest.mark.integration

GEOFED = [sys.executable, "-m", "geofed.cli"]
THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GEOFED, *args], capture_output=True, text=True, timeout=300, check=False, cwd=cwd
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("cli-errors")
    bad_csv = d / "sites.csv"
    bad_csv.write_text("id,name,lat,lon\na,A,10,20\nb,B,abc,30\n")
    trace = d / "w.jsonl"
    write_trace(generate(WorkloadConfig(scenario="mobile", clients=4, duration_s=2, seed=1)), trace)
    existing = d / "deliveries.jsonl"
    existing.write_text("keep me\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nobody listens once the socket is closed
    return {
        "bad_csv": str(bad_csv),
        "trace": str(trace),
        "missing": str(d / "missing.jsonl"),
        "no_dir": str(d / "no" / "such" / "dir" / "d.jsonl"),
        "existing": str(existing),
        "existing_dir": str(d),  # not empty: it holds the file above
        "closed": f"127.0.0.1:{closed}",
    }


BRIDGE = ["bridge-topics", "--mqtt", "{closed}", "--federation", "three", "--client", "b"]
# A client of a broker nobody runs: for mistakes found before it would connect.
AT_CLOSED = ["--endpoint", "{closed}", "--client", "c", "--location", "1,2"]

CASES = [
    # (name, argv with {placeholders}, exit code, text the message must contain)
    ("route: circle with two numbers", ["route", "circle:35,139"], 2, "geofence"),
    ("route: circle with a word", ["route", "circle:abc,1,2"], 2, "geofence"),
    ("route: location not LAT,LON", ["route", "world", "--location", "abc"], 2, "location"),
    ("route: unknown federation", ["route", "world", "--federation", "nope"], 2, "federation"),
    ("route: roaming geofence", ["route", "roam:circle:5000"], 2, "only as a subscription"),
    (
        "publish: roaming event geofence",
        ["publish", *AT_CLOSED, "--topic", "t", "--geofence", "roam:circle:5000"],
        2,
        "only as a subscription",
    ),
    (
        "subscribe: bad roaming radius",
        ["subscribe", *AT_CLOSED, "--topic", "t/#", "--geofence", "roam:circle:0.5"],
        2,
        "geofence.radius_m",
    ),
    ("areas: a bad CSV row", ["areas", "{bad_csv}"], 2, "line 3: lat"),
    ("areas: missing file", ["areas", "{missing}"], 2, "missing.jsonl"),
    ("simulate: missing trace", ["simulate", "{missing}"], 2, "workload"),
    ("replay: missing trace", ["replay", "{missing}", "--federation", "three"], 2, "workload"),
    (
        "replay: delivery log in a missing folder",
        ["replay", "{trace}", "--federation", "three", "--deliveries", "{no_dir}"],
        2,
        "deliveries",
    ),
    (
        "replay: an existing delivery log is not overwritten",
        ["replay", "{trace}", "--federation", "three", "--deliveries", "{existing}"],
        2,
        "--force",
    ),
    ("bench: missing workload", ["bench", "--workload", "{missing}"], 2, "workload"),
    (
        "bench: a scenario beside a workload file",
        ["bench", "--workload", "{trace}", "--scenario", "mobile"],
        2,
        "scenario",
    ),
    (
        "publish: empty client id",
        ["publish", "--endpoint", "{closed}", "--client", "", "--location", "1,2", "--topic", "a"],
        2,
        "client_id",
    ),
    (
        "publish: latitude out of range",
        [
            "publish",
            "--endpoint",
            "{closed}",
            "--client",
            "c",
            "--location",
            "91,2",
            "--topic",
            "a",
        ],
        2,
        "location.lat",
    ),
    (
        "publish: a bad circle",
        [
            "publish",
            "--endpoint",
            "{closed}",
            "--client",
            "c",
            "--location",
            "1,2",
            "--topic",
            "a",
            "--geofence",
            "circle:1,2",
        ],
        2,
        "geofence",
    ),
    (
        "publish: no broker runs",
        ["publish", "--endpoint", "{closed}", "--client", "c", "--location", "1,2", "--topic", "a"],
        3,
        "unavailable",
    ),
    (
        "subscribe: negative count",
        [
            "subscribe",
            "--endpoint",
            "{closed}",
            "--client",
            "c",
            "--location",
            "1,2",
            "--topic",
            "a",
            "--count",
            "-1",
        ],
        2,
        "count",
    ),
    (
        "node: unknown broker in a bundled federation",
        ["node", "--federation", "three", "--broker-id", "nope"],
        2,
        "nope",
    ),
    (
        "workload: an existing output file is not overwritten",
        ["workload", "mobile", "-o", "{existing}", "--clients", "2"],
        2,
        "error: output: ",
    ),
    (
        "analyze: an existing output folder is not written into",
        ["analyze", "-f", "three", "-w", "{trace}", "-o", "{existing_dir}"],
        2,
        "error: out: ",
    ),
    (
        "bench: an existing report folder is not written into",
        ["bench", "--out", "{existing_dir}", "--no-analysis", "--no-plots"],
        2,
        "error: out: ",
    ),
    (
        "bench: an existing work folder is not written into",
        ["bench", "--workdir", "{existing_dir}", "--no-analysis", "--no-plots"],
        2,
        "error: workdir: ",
    ),
    (
        "demo: an existing report folder is not written into",
        ["demo", "--out", "{existing_dir}"],
        2,
        "error: out: ",
    ),
    ("cover: geofence not a shape", ["cover", "POLYGON((0 0, 1 1))"], 2, "geofence"),
    ("cover: coverage beyond 1", ["cover", "world", "--coverage", "2"], 2, "coverage"),
    ("cover: no filter allowed", ["cover", "world", "--max-filters", "0"], 2, "max_filters"),
    (
        "cover: four quadrants, three filters",
        ["cover", "POLYGON((-1 -1, 1 -1, 1 1, -1 1, -1 -1))", "--max-filters", "3"],
        2,
        "at least 4",
    ),
    ("cover: too many decimals", ["cover", "world", "--decimals", "12"], 2, "layout.decimals"),
    ("cover: a bad topic filter", ["cover", "world", "--topic", "a/#/b"], 2, "topic_filter"),
    ("bridge-topics: nothing to bridge", [*BRIDGE], 2, "export"),
    (
        "bridge-topics: MQTT address without a port",
        ["bridge-topics", "--mqtt", "localhost", "--federation", "three", "--client", "b"],
        2,
        "mqtt",
    ),
    ("bridge-topics: an export needs a location", [*BRIDGE, "--export", "#"], 2, "location"),
    (
        "bridge-topics: an import needs the federation",
        [*BRIDGE[:3], "--endpoint", "{closed}", "--client", "b", "--import", "#"],
        2,
        "federation",
    ),
    ("bridge-topics: a bad import filter", [*BRIDGE, "--import", "a/#/b"], 2, "import"),
    (
        "bridge-topics: a password without its user",
        [*BRIDGE, "--import", "#", "--mqtt-password-file", "{missing}"],
        2,
        "mqtt-user",
    ),
    (
        "bridge-topics: an unreadable password file",
        [*BRIDGE, "--import", "#", "--mqtt-user", "u", "--mqtt-password-file", "{missing}"],
        2,
        "mqtt-password-file",
    ),
    (
        "bridge-topics: a client certificate without the broker's CA",
        [*BRIDGE, "--import", "#", "--mqtt-cert", "{missing}", "--mqtt-key", "{missing}"],
        2,
        "mqtt-ca",
    ),
    (
        "bridge-topics: an unreadable MQTT CA",
        [*BRIDGE, "--import", "#", "--mqtt-ca", "{missing}"],
        2,
        "mqtt-ca",
    ),
    (
        "bridge-topics: nobody listens on the MQTT port",
        [*BRIDGE, "--import", "sensors/#"],
        3,
        "MQTT broker",
    ),
    (
        "analyze: bundled federation, missing workload",
        ["analyze", "-f", "three", "-w", "{missing}", "-o", "{no_dir}"],
        2,
        "missing.jsonl",
    ),
]


@pytest.mark.parametrize(("name", "argv", "code", "needle"), CASES, ids=[c[0] for c in CASES])
def test_a_mistake_gets_one_line_and_an_exit_code(
    name: str, argv: list[str], code: int, needle: str, files: dict[str, str], tmp_path: Path
) -> None:
    out = run(*(a.format(**files) for a in argv), cwd=tmp_path)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == code, (out.returncode, out.stderr)
    assert needle in out.stderr, out.stderr
    assert out.stderr.startswith(f"geofed {argv[0]}: error:"), out.stderr
    assert Path(files["existing"]).read_text() == "keep me\n"
    assert not list(tmp_path.iterdir()), "a failed command left files behind"


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with LocalFederation(THREE, "event-geofence", tmp_path_factory.mktemp("fed")) as fed:
        yield fed


def test_a_rejected_subscription_is_reported_before_anything_is_printed(
    running: LocalFederation,
) -> None:
    out = run(
        "subscribe",
        "--federation",
        str(running.federation_path),
        "--client",
        "c",
        "--location",
        "48.85,2.35",
        "--topic",
        "a/#/b",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "subscription.topic_filter" in out.stderr and "subscribed" not in out.stderr


def test_a_folder_where_a_file_is_expected_is_named(tmp_path: Path) -> None:
    out = run("areas", str(tmp_path))  # IsADirectoryError: an OSError with the file name
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert str(tmp_path) in out.stderr


def test_help_shows_defaults_and_required_options() -> None:
    text = " ".join(run("bench", "--help").stdout.split())
    assert "(default: mobile)" in text and "(default: out/bench/report)" in text
    assert "(required)" in " ".join(run("analyze", "--help").stdout.split())
