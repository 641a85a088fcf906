"""Helpers shared by the Spark tests (a module of its own: every tests/ folder has a conftest)."""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from geofed.bench.analysis import Analysis, AnalysisConfig, Progress, analyze

REPO = Path(__file__).resolve().parents[2]
THREE = REPO / "deploy" / "federations" / "three.geojson"
AWS = REPO / "deploy" / "federations" / "aws-2020.geojson"


def write_jsonl(path: Path, records: Iterable[Any]) -> Path:
    """Write records (dicts, or raw strings as they are) one per line."""
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path


RESULTS: list[Analysis] = []
"""The results `run` gave in the running test; conftest releases them after it."""


def run(spark: Any, fed_path: Path, trace: Path, **kw: Any) -> Analysis:
    """The job on one trace, progress lines swallowed."""
    cfg = AnalysisConfig(federation=str(fed_path), workload=(str(trace),), **kw)
    result = analyze(spark, cfg, Progress(None, out=io.StringIO()))
    RESULTS.append(result)
    return result


def spark_counts(result: Analysis) -> dict[str, Counter[tuple[str, ...]]]:
    """Messages per strategy by (kind, src, dst); lower bound and payload bytes by (src, dst)."""
    return message_counts(r.asDict() for r in result.messages.collect())


def message_counts(rows: Iterable[dict[str, Any]]) -> dict[str, Counter[tuple[str, ...]]]:
    """`spark_counts` of rows of the messages table (collected, or read from its Parquet)."""
    out: dict[str, Counter[tuple[str, ...]]] = {}
    for r in rows:
        s = r["strategy"]
        if s == "lower-bound":
            out.setdefault(s, Counter())[(r["src"], r["dst"])] += r["messages"]
        else:
            out.setdefault(s, Counter())[(r["kind"], r["src"], r["dst"])] += r["messages"]
            if r["kind"] in ("event", "delivery"):
                out.setdefault(s + ":bytes", Counter())[(r["src"], r["dst"])] += r["bytes"]
    return out
