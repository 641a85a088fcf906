"""Every metric the node exports is in docs/design.md's metrics table, and nothing else is."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from geofed.node import NodeMetrics

DESIGN = Path(__file__).resolve().parents[3] / "docs" / "design.md"


def test_the_design_documents_exactly_the_metrics_the_node_exports() -> None:
    registry = CollectorRegistry()
    NodeMetrics(registry)
    exported = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in registry.collect()
    }
    text = DESIGN.read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(geofed_[a-z0-9_]+)", text, re.MULTILINE))
    assert exported - documented == set(), "exported, not documented"
    assert documented - exported == set(), "documented, not exported"
