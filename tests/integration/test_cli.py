"""The ``geofed`` command line end to end: up, publish, subscribe, replay, demo."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from geofed.bench import LocalFederation, WorkloadConfig, generate, write_trace
from geofed.routing import reference_deliveries

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
GEOFED = [sys.executable, "-m", "geofed.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GEOFED, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@contextlib.contextmanager
def up(*args: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`geofed up ARGS` once every broker is linked: the process and what it printed."""
    with subprocess.Popen(
        [*GEOFED, "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:
        assert proc.stdout is not None
        lines = []
        while True:  # `up` prints the table, then this line once every broker is linked
            line = proc.stdout.readline()
            lines.append(line)
            if "all brokers healthy" in line or not line:
                break
        assert any("all brokers healthy" in line for line in lines), lines
        yield proc, lines


@contextlib.contextmanager
def subscribed(*args: str) -> Iterator[subprocess.Popen[str]]:
    """`geofed subscribe ARGS` for one news/# delivery in Singapore, once it holds at ap."""
    with subprocess.Popen(
        [
            *GEOFED,
            "subscribe",
            *args,
            *("--client", "s", "--location", "1.3,103.8", "--topic", "news/#"),
            *("--id", "sub1", "--count", "1"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as sub:
        assert sub.stderr is not None
        assert "subscribed sub1 at broker ap" in sub.stderr.readline()
        yield sub


def test_up_starts_a_federation_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    args = ("--strategy", "subscription-geofence", "--workdir", str(tmp_path))
    with up(str(THREE), *args) as (proc, lines):
        table = "".join(lines)
        for broker in ("eu", "us", "ap"):
            assert broker in table
        assert "http://127.0.0.1:" in table
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    for broker in ("eu", "us", "ap"):
        assert "stopped" in (tmp_path / f"node-{broker}.log").read_text()


def test_up_tls_runs_a_secured_federation_that_the_cli_clients_reach(tmp_path: Path) -> None:
    """`geofed up --tls`: brokers on a throw-away CA; publish and subscribe with --ca."""
    with up(str(THREE), "--tls", "--workdir", str(tmp_path)) as (proc, lines):
        assert any(line.startswith("TLS: CA ") for line in lines), lines
        fed_file = str(tmp_path / "federation.geojson")
        common = ["--federation", fed_file, "--ca", str(tmp_path / "certs" / "ca.pem")]
        publish = ("--client", "p", "--location", "50.1,8.7", "--topic", "news/eu")
        with subscribed(*common) as sub:
            out = run("publish", *common, *publish)
            assert out.returncode == 0, out.stderr
            stdout, _ = sub.communicate(timeout=30)
        assert json.loads(stdout.splitlines()[0])["topic"] == "news/eu"
        # Without the CA the broker's certificate is not trusted: a clear failure, exit 3.
        plain = run("publish", "--federation", fed_file, *publish)
        assert plain.returncode == 3, plain.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_publish_and_subscribe_commands_follow_redirects(tmp_path: Path) -> None:
    with LocalFederation(THREE, "event-geofence", tmp_path) as fed:
        fed_file = str(fed.federation_path)
        with subscribed("--federation", fed_file) as sub:
            out = run(
                "publish",
                "--federation",
                fed_file,
                "--client",
                "p",
                "--location",
                "50.1,8.7",
                "--topic",
                "news/eu",
                "--payload",
                "hello",
                "--geofence",
                "POLYGON((90 -10, 120 -10, 120 10, 90 10, 90 -10))",
            )
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["broker"] == "eu"
            stdout, _ = sub.communicate(timeout=30)
        got = json.loads(stdout.splitlines()[0])
        assert (got["subscription"], got["payload"], got["topic"]) == ("sub1", "hello", "news/eu")
        bad = run(
            "publish",
            "--federation",
            fed_file,
            "--client",
            "p",
            "--location",
            "50.1,8.7",
            "--topic",
            "news/+",
        )
        assert bad.returncode != 0 and "topic" in bad.stderr


def test_subscribe_takes_a_roaming_geofence(tmp_path: Path) -> None:
    # Publishers within 300 km of the subscriber (in Singapore): one from
    # Frankfurt is not delivered, one from 130 km away is.
    with LocalFederation(THREE, "subscription-geofence", tmp_path) as fed:
        fed_file = str(fed.federation_path)
        with subscribed("--federation", fed_file, "--geofence", "roam:circle:300000") as sub:
            for where, text in (("50.1,8.7", "far"), ("2.5,103.8", "near")):
                out = run("publish", "--federation", fed_file, "--client", "p", "--location",
                          where, "--topic", "news/x", "--payload", text)  # fmt: skip
                assert out.returncode == 0, out.stderr
            stdout, _ = sub.communicate(timeout=30)
        assert [json.loads(line)["payload"] for line in stdout.splitlines()] == ["near"]


def test_replay_writes_the_delivery_log(tmp_path: Path) -> None:
    ops = list(
        generate(
            WorkloadConfig(scenario="open-data", clients=20, duration_s=5, seed=3, world_share=0.5)
        )
    )
    trace = tmp_path / "w.jsonl"
    write_trace(ops, trace)
    with LocalFederation(THREE, "subscription-geofence", tmp_path / "fed") as fed:
        urls = list(fed.metrics_urls().values())
        out = run(
            "replay",
            str(trace),
            "--federation",
            str(fed.federation_path),
            "--deliveries",
            str(tmp_path / "d.jsonl"),
            "--metrics",
            *urls,
        )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert {"event", "subscription", "client", "t_publish", "t_deliver"} <= set(records[0])
    assert sorted((r["event"], r["subscription"]) for r in records) == sorted(
        reference_deliveries(ops)
    )


def test_demo_compares_every_strategy(tmp_path: Path) -> None:
    out = run(
        "demo",
        "--federation",
        "three",
        "--clients",
        "12",
        "--duration",
        "4",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "report"),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    # The demo is a preset of `geofed bench`: exact (barrier) runs, one table.
    assert "inter-region messages measured from the nodes' metrics" in out.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    # TLS by default (mutual TLS between the brokers, TLS to the replay's clients).
    assert report["settings"]["barrier"] and report["settings"]["tls"]
    assert report["analysis"] is None
    rows = report["strategies"]
    assert [r["strategy"] for r in rows] == [
        "flooding-events",
        "flooding-subscriptions",
        "event-geofence",
        "subscription-geofence",
    ]
    for r in rows:
        d = r["deliveries"]
        assert r["messages"]["total"] == r["model"]["total"]
        assert d["recall"] == 1.0 and d["precision"] == 1.0 and d["duplicates"] == 0
        assert f"{r['strategy']:<24}{r['messages']['event']:>7}" in out.stdout


def test_route_and_simulate_commands(tmp_path: Path) -> None:
    out = run(
        "route",
        "--federation",
        "aws-2020",
        "--json",
        "POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))",
    )
    result = json.loads(out.stdout)
    assert result["origin"] == "eu-central-1" and result["flooding_messages"] == 20
    assert result["geofence_messages"] == len(result["brokers_meeting"]) < 20
    trace = tmp_path / "w.jsonl"
    write_trace(
        generate(WorkloadConfig(scenario="mobile", clients=15, duration_s=5, seed=2)), trace
    )
    out = run("simulate", str(trace), "--federation", "three", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert all(r["exact"] and r["matches_cost_model"] for r in summary["strategies"])
    totals = {r["strategy"]: r["total"] for r in summary["strategies"]}
    # A per-topic table: the scenario's every topic is under sensors/, so the entry
    # decides for all of them, whatever the default.
    out = run(
        "simulate",
        str(trace),
        "--federation",
        "three",
        "--strategy",
        "event-geofence",
        "--table",
        '{"sensors/#": "subscription-geofence", "alerts/#": "flooding-events"}',
        "--json",
    )
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["strategies"]
    assert row["strategy"] == "event-geofence + table" and row["exact"]
    assert row["matches_cost_model"] and row["total"] == totals["subscription-geofence"]
    assert totals["subscription-geofence"] != totals["event-geofence"]
    out = run("simulate", str(trace), "--table", '{"sensors/#": "nearest"}')
    assert out.returncode == 2 and "table.entries[0].strategy" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "op": "publish"}\n')
    out = run("simulate", str(bad), "--federation", "three")
    assert out.returncode == 2 and "line 1" in out.stderr
