"""`bench/spark_steps_bench.py` runs the job's own validation code and names its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from spark_helpers import THREE, write_jsonl
from test_spark_known import THREE_TRACE

from geofed.bench import spark_steps_bench

pytestmark = pytest.mark.spark


def _steps(table: str) -> list[str]:
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return [row.split(" | ")[0].removeprefix("| ") for row in rows[1:]]


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_steps_name_each_checkpoint_of_the_stage(spark: Any, tmp_path: Path, fmt: str) -> None:
    if fmt == "json":
        # One line the JVM cannot vouch for: the rows parse_op reads get a checkpoint.
        trace = write_jsonl(tmp_path / "w.jsonl", [*(json.dumps(r) for r in THREE_TRACE), "oops"])
    else:
        trace = tmp_path / "w.parquet"
        pq.write_table(pa.Table.from_pylist([dict(r) for r in THREE_TRACE]), trace)
    results = tmp_path / "steps.md"
    argv = ["-w", str(trace), "-f", str(THREE), "--rounds", "1", "--results", str(results)]
    assert spark_steps_bench.main(argv) == 0
    text = results.read_text()
    assert "Command: `python -m geofed.bench.spark_steps_bench -w <workdir>/w." in text
    assert str(tmp_path) not in text  # no machine paths in the results file
    steps = _steps(text)
    want = [
        "numbering (read_numbered)",
        "reference: the numbered trace, read",
        "reference: typed records and pre-check",
        *(["checkpoint: decoded records"] if fmt == "json" else []),
        "checkpoint: distinct points and geofence texts, answered",
        "checkpoint: validated rows (answers joined)",
        *(["checkpoint: rows parse_op read"] if fmt == "json" else []),
        "rest: counts, planning",
        "validation stage (parse_workload)",
    ]
    assert steps == want
