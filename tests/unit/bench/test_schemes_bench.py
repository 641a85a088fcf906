"""A CI-sized run of the filter-scheme benchmark (bench/schemes_bench.py).

The load goes through both thresholds and back, so the broker makes the
paper's four transitions; the shape of its figures must hold: recall 1
through T1 with state transfer, a dip without, none at all when the broker
bootstraps from its own copy, and GRID's complexity bounded by its channels.
"""

from __future__ import annotations

from pathlib import Path

from geofed.bench import schemes_bench as sb

SMALL = {
    "duration": 24.0,
    "peak": 30,
    "low": 6,
    "rgrid_at": 12,
    "grid_at": 22,
    "rtt": 0.4,
    "bin_s": 1.0,
    "seed": 3,
}


def test_the_four_transitions_and_their_recall() -> None:
    runs = {v: sb.run(v, **SMALL) for v in sb.VARIANTS}  # type: ignore[arg-type]
    for r in runs.values():
        assert [(s, t) for _, s, t in r.transitions] == [
            ("exact", "rgrid"),
            ("rgrid", "grid"),
            ("grid", "rgrid"),
            ("rgrid", "exact"),
        ]
        assert r.events > 100
    phase = {v: sb.phases(r) for v, r in runs.items()}
    # Every event matches at least its publisher's own roaming circle.
    for v in sb.VARIANTS:
        first_exact, _, grid, _, last_exact = phase[v]
        assert first_exact[3] == 1.0 and first_exact[4] == 1.0  # EXACT is the oracle
        assert grid[0] == "grid" and grid[5] <= max(runs[v].clients)  # one channel per sub
        assert last_exact[4] == 1.0  # precision 1 again under EXACT
    assert phase["transfer"][1][3] == 1.0  # T1 with state transfer: recall stays 1
    assert phase["broker"][1][3] == 1.0 and phase["broker"][3][3] == 1.0  # also after T3
    assert phase["broker"][4][3] == 1.0  # and T4: nothing is awaited from clients
    assert runs["broker"].awaited == 0
    assert phase["no-transfer"][1][3] < 1.0  # resubscriptions take a round trip
    assert runs["no-transfer"].awaited > runs["transfer"].awaited > 0
    assert phase["transfer"][1][4] < 1.0  # RGRID's precision is below 1
    # The paper's Fig. 10: right after T4 the fenced subscriptions are awaited
    # from their clients, with or without state transfer; geofed's broker has them.
    window = SMALL["rtt"]
    assert sb.dips(runs["transfer"], window)[0] == 1.0
    assert sb.dips(runs["transfer"], window)[3] < 1.0
    assert sb.dips(runs["no-transfer"], window)[0] < 1.0
    assert sb.dips(runs["broker"], window)[3] == 1.0


def test_main_writes_the_plot_and_the_table(tmp_path: Path) -> None:
    argv = [
        "--duration=12",
        "--peak=16",
        "--low=4",
        "--rgrid-at=8",
        "--grid-at=12",
        "--bin=1",
        f"--out={tmp_path}",
    ]
    assert sb.main(argv) == 0
    text = (tmp_path / "schemes.md").read_text()
    assert "| transfer | rgrid |" in text
    assert "Command: `python -m geofed.bench.schemes_bench" in text
    assert (tmp_path / "schemes.png").stat().st_size > 10_000
