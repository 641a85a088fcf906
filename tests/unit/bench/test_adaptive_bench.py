"""A CI-sized run of the adaptive benchmark: it writes its table and plot, and stays exact."""

from __future__ import annotations

import re
from pathlib import Path

from geofed.bench import adaptive_bench


def test_the_benchmark_writes_exact_rows_and_the_plot(tmp_path: Path) -> None:
    argv = [
        "--federation",
        "three",
        "--clients",
        "24",
        "--duration",
        "20",
        "--mixed-duration",
        "40",
        "--window",
        "5",
        "--scenarios",
        "mixed,context",
        "--out",
        str(tmp_path),
    ]
    assert adaptive_bench.main(argv) == 0
    text = (tmp_path / "adaptive.md").read_text()
    assert "Command: `python -m geofed.bench.adaptive_bench --federation three" in text
    assert (tmp_path / "adaptive-mixed.png").stat().st_size > 10_000
    rows = [
        line for line in text.splitlines() if re.match(r"\| (adaptive|flooding|event|sub)", line)
    ]
    assert len(rows) == 2 * 6  # two scenarios: four static runs, two adaptive
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[5:9] == ["1.0000", "1.0000", "0", "yes"], row
