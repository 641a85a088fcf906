"""The store benchmark's replay: a row per cache size and round, its memory within the cache."""

from __future__ import annotations

import pytest

from geofed.bench.store_bench import main, run_once


def test_a_replay_outgrows_its_cache_and_sqlite_keeps_within_it() -> None:
    run = run_once(cache_kib=64, events=4000, window=8000, payload_bytes=200)
    assert run.events == 4000 and run.wall_s > 0 and run.cpu_s > 0
    assert run.file_mib > 4 * 64 / 1024, run  # the file is many times the cache
    assert 0 < run.sqlite_mib <= (64 + 160) / 1024, run  # cache + schema and statements


def test_main_prints_a_row_per_cache_size_and_round(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--cache-kib", "64,128", "--events", "200", "--rounds", "2", "--no-record"]
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 ")]
    assert len(rows) == 4  # printed as it goes and again in the table, for 2 rounds
