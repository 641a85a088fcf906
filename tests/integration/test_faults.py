"""Faults under cross-region load, every strategy: nothing lost, duplicated or unexpected.

Each case runs one fault cycle on a fresh three-broker federation (durable
data directories, a fault proxy on every peer link) under a steady load of
one publisher and four subscriptions with mixed geofences
(`geofed.bench.faults`): load, fault, load during the fault, heal, wait for
health, load; then a marker event settles the run and the history checker
holds every acknowledged event against the oracle. Waits are on state only.

The kill cases need durable brokers (docs/design.md §8): without a store, a
broker killed mid-load loses what it held, and these cases say so.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from geofed.bench.faults import FAULTS, run_faults
from geofed.routing import STRATEGIES

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fault_cycle_loses_duplicates_and_invents_nothing(
    strategy: str, fault: str, tmp_path: Path
) -> None:
    result = asyncio.run(run_faults(strategy, fault, cycles=1, workdir=tmp_path))
    report = result.report
    # The cycle did what it says: load crossed regions, and a kill restarted a broker.
    assert report.required > 0 and report.acknowledged > 0, str(result)
    assert result.restarts == (1 if fault.startswith("kill-") else 0)
    assert result.ok, str(result)
    assert report.delivered == report.required
