"""The soak (``python -m geofed.bench.soak``) run tiny: bounded by events, checked by its report.

A few hundred acknowledged events on a durable three-broker federation with
churn steps every few dozen: nothing lost, duplicated or unexpected, and the
report and the RSS plot are written with a row per node (with the memory
SQLite holds in it). The run ends on
events acknowledged and on the settled markers, never on a clock.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from geofed.bench.soak import REGIONS, main, slope_mib_per_h

pytestmark = pytest.mark.integration


def test_a_tiny_soak_loses_nothing_and_reports_memory_per_node(tmp_path: Path) -> None:
    out = tmp_path / "soak.md"
    argv = ["--events", "240", "--churn-every", "40", "--sample-s", "0.5", "--out", str(out)]
    assert main([*argv, "--workdir", str(tmp_path / "work")]) == 0
    text = out.read_text()
    assert text.startswith("# Soak: a durable federation at steady load")
    assert "Command: `python -m geofed.bench.soak --events 240" in text
    assert "Machine: " in text and "Load average" in text
    verdict = re.search(
        r"\| [\d.]+ min \| ([\d,]+) of ([\d,]+) \| ([\d,]+) \| ([\d,]+) of ([\d,]+)"
        r" \| 0 \| 0 \| 0 \| ok \|",
        text,
    )
    assert verdict is not None, text
    acked, _, received, delivered, required = (int(g.replace(",", "")) for g in verdict.groups())
    assert acked >= 240 and received >= delivered == required > 0
    churns = re.search(r"(\d+) churn steps", text)
    assert churns is not None and int(churns.group(1)) >= 240 // 40, text
    for broker in REGIONS:
        row = re.search(
            rf"^\| {broker} \| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|.* \| ([\d.]+) → ([\d.]+) \|$",
            text,
            re.M,
        )
        assert row is not None and int(row.group(1)) >= 2, text  # at the start and at the end
        # SQLite's memory, from each node's geofed_sqlite_memory_bytes: its caches in use
        assert 0 < float(row.group(3)) < 16, text
    assert "![RSS over time](soak-rss.png)" in text
    png = tmp_path / "soak-rss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_rss_slope_is_a_least_squares_line_in_mib_per_hour() -> None:
    assert slope_mib_per_h([(0.0, 100.0), (1800.0, 101.0), (3600.0, 102.0)]) == pytest.approx(2)
    assert slope_mib_per_h([(0.0, 50.0), (60.0, 50.0)]) == 0.0
    assert slope_mib_per_h([(5.0, 70.0)]) == 0.0
