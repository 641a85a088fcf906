"""Progress (tqdm) on stderr, on a terminal only; output folders are never silently reused."""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
from pathlib import Path

import pytest

from geofed import cli
from geofed.bench import WorkloadConfig, compare, generate, write_trace
from geofed.cli import progress
from geofed.routing import InvalidInput


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _progress_not_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEOFED_PROGRESS", raising=False)


@pytest.fixture
def trace(tmp_path: Path) -> str:
    path = tmp_path / "w.jsonl"
    write_trace(generate(WorkloadConfig(scenario="mobile", clients=5, duration_s=5, seed=1)), path)
    return str(path)


def test_enabled_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not progress.enabled(io.StringIO())
    assert progress.enabled(_Terminal())
    monkeypatch.setenv("GEOFED_PROGRESS", "0")
    assert not progress.enabled(_Terminal())


def test_track_is_silent_in_logs_and_draws_on_a_terminal() -> None:
    log = io.StringIO()
    assert list(progress.track(range(50), "x", stream=log)) == list(range(50))
    assert log.getvalue() == ""
    term = _Terminal()
    assert list(progress.track(list(range(50)), "counting", stream=term)) == list(range(50))
    assert "\r" in term.getvalue() and "counting" in term.getvalue()
    counter = _Terminal()  # no length: a counter
    assert sum(progress.track(iter(range(5)), "n", stream=counter)) == 10
    assert "\r" in counter.getvalue()


def test_simulate_progress_goes_to_a_terminal_stderr_never_stdout(
    trace: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["simulate", trace, "--json"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""  # stderr is not a terminal here: nothing drawn, no '\r'
    json.loads(quiet.out)
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert cli.main(["simulate", trace, "--json"]) == 0
    assert capsys.readouterr().out == quiet.out
    assert "\r" in term.getvalue() and "simulate flooding-events" in term.getvalue()


def test_workload_to_stdout_keeps_the_trace_clean(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["workload", "context", "-o", "-", "--clients", "3", "--seed", "2"]) == 0
    quiet = capsys.readouterr()
    assert "\r" not in quiet.err and quiet.err.count("\n") == 1  # the summary line only
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert cli.main(["workload", "context", "-o", "-", "--clients", "3", "--seed", "2"]) == 0
    assert capsys.readouterr().out == quiet.out
    assert "\r" in term.getvalue()


def test_workload_refuses_an_existing_file_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w.jsonl"
    out.write_text("keep me\n")
    assert cli.main(["workload", "context", "-o", str(out), "--clients", "3"]) == 2
    assert "output:" in capsys.readouterr().err and out.read_text() == "keep me\n"
    assert cli.main(["workload", "context", "-o", str(out), "--clients", "3", "--force"]) == 0
    assert out.read_text() != "keep me\n"


def test_bench_progress_prints_lines_in_logs_and_a_bar_on_a_terminal() -> None:
    log = io.StringIO()
    p = compare._Progress(log)
    p.bar("fe: actions", 1, 10)
    p.bar("fe: actions", 5, 10, ", 2 deliveries")
    p.say("fe: done")
    assert "\r" not in log.getvalue() and log.getvalue().count("\n") == 3
    term = _Terminal()
    p = compare._Progress(term)
    p.bar("fe: actions", 5, 10, ", 2 deliveries")
    p.say("fe: done")
    assert "\r" in term.getvalue() and term.getvalue().endswith("fe: done\n")


def test_analyze_progress_is_one_line_per_stage_in_logs_and_live_on_a_terminal() -> None:
    pytest.importorskip("pyspark")
    from geofed.bench.analysis import Progress

    log = io.StringIO()
    p = Progress(None, log)
    with p.stage("matching"):
        p.say("  12 pairs")
    text = log.getvalue()
    assert "\r" not in text and text.count("\n") == 3 and "matching: done in" in text
    term = _Terminal()
    p = Progress(None, term)
    with p.stage("matching"):
        pass
    assert "\r" in term.getvalue() and "matching: done in" in term.getvalue()


def _bench_args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.register(parser.add_subparsers(), "bench")
    args = parser.parse_args(["bench", *argv])
    args.output_root = str(tmp_path / "out" / "bench")
    return args


def test_bench_default_folders_are_never_reused(tmp_path: Path) -> None:
    root = tmp_path / "out" / "bench"
    assert compare._output_folders(_bench_args(tmp_path)) == (root / "report", root / "work")
    (root / "report").mkdir(parents=True)
    (root / "report" / "report.md").write_text("earlier\n")
    now = dt.datetime(2026, 11, 26, 7, 10, 0)
    fresh = root / "2026-11-26T07-10-00"
    assert compare._output_folders(_bench_args(tmp_path), now) == (
        fresh / "report",
        fresh / "work",
    )
    fresh.mkdir()
    assert compare._output_folders(_bench_args(tmp_path), now)[0].parent.name.endswith("-2")
    args = _bench_args(tmp_path, "--force")
    assert compare._output_folders(args) == (root / "report", root / "work")


def test_bench_explicit_folders_need_force_when_not_empty(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    assert compare._output_folders(_bench_args(tmp_path, "--out", str(mine)))[0] == mine
    (mine / "x").write_text("x")
    with pytest.raises(InvalidInput, match=r"^out: "):
        compare._output_folders(_bench_args(tmp_path, "--out", str(mine)))
    with pytest.raises(InvalidInput, match=r"^workdir: "):
        compare._output_folders(_bench_args(tmp_path, "--workdir", str(mine)))
    args = _bench_args(tmp_path, "--out", str(mine), "--force")
    assert compare._output_folders(args)[0] == mine
