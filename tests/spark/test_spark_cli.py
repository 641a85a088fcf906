"""The command line: ``geofed analyze`` (register/run), and ``spark-submit bench/analyze.py``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from spark_helpers import REPO, THREE, write_jsonl
from test_spark_known import THREE_TRACE

from geofed.bench import analyze
from geofed.bench.analysis._session import properties

pytestmark = pytest.mark.spark


def test_subcommand_writes_table_json_parquet_and_plots(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="geofed")
    analyze.register(parser.add_subparsers(dest="command"), "analyze")
    trace = write_jsonl(tmp_path / "t.jsonl", [*THREE_TRACE, "oops"])
    out = tmp_path / "out"
    args = parser.parse_args(["analyze", "-f", str(THREE), "-w", str(trace), "-o", str(out)])
    assert args.func is analyze.run
    assert args.func(args) == 0
    captured = capsys.readouterr()
    table = captured.out
    for name in (
        "flooding-events",
        "flooding-subscriptions",
        "event-geofence",
        "subscription-geofence",
        "lower-bound",
    ):
        assert name in table
    assert "1 malformed workload rows" in table and "line 7: not JSON" in table
    assert "[geofed analyze" in captured.err and "done in" in captured.err  # progress per stage
    for f in ("summary.json", "savings.png", "heatmap.png"):
        assert (out / f).is_file()
    for d in ("messages.parquet", "errors.parquet"):
        assert any((out / d).glob("*.parquet"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategies"]["event-geofence"]["messages"] == 2
    assert (out / "savings.png").read_bytes()[:4] == b"\x89PNG"
    assert spark.sparkContext._jsc is not None  # run() left the shared session running


def test_spark_submit_runs_the_file(tmp_path: Path) -> None:
    # As a file, outside the package: it must still import geofed.* from the
    # installed package (its Python workers too).
    spark_submit = Path(sys.executable).with_name("spark-submit")
    if not spark_submit.exists():
        pytest.skip(f"no spark-submit next to {sys.executable}")
    trace = write_jsonl(tmp_path / "t.jsonl", THREE_TRACE)
    out = tmp_path / "out"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [
            str(spark_submit),
            "--master",
            "local[1]",
            "--driver-memory",
            "1g",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.sql.shuffle.partitions=2",
            str(REPO / "bench" / "analyze.py"),
            "-f",
            str(THREE),
            "-w",
            str(trace),
            "-o",
            str(out),
            "--no-plots",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "event-geofence" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["deliveries"] == 2


_JVM_SETTINGS = """
import sys
from geofed.bench.analysis._session import build_session
spark = build_session("local[1]", "1g", sys.argv[1:])
jvm = spark.sparkContext._jvm
beans = jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
print(sorted(str(b.getName()) for b in beans), spark.conf.get("spark.serializer"))
spark.stop()
"""
KRYO = "org.apache.spark.serializer.KryoSerializer"
JAVA = "org.apache.spark.serializer.JavaSerializer"
PARALLEL = ["PS MarkSweep", "PS Scavenge"]
SERIAL = ["Copy", "MarkSweepCompact"]


@pytest.mark.parametrize(
    ("conf", "defaults", "collectors", "serializer"),
    [
        ([], None, PARALLEL, KRYO),
        (["spark.driver.extraJavaOptions=-XX:+UseSerialGC"], None, SERIAL, KRYO),
        # A spark-defaults.conf's settings win over the job's defaults ...
        (
            [],
            f"spark.driver.extraJavaOptions  -XX:+UseSerialGC\nspark.serializer={JAVA}\n",
            SERIAL,
            JAVA,
        ),
        # ... and --conf over the file.
        (
            [f"spark.serializer={KRYO}"],
            f"# settings\nspark.serializer {JAVA}\n",
            PARALLEL,
            KRYO,
        ),
    ],
)
def test_a_local_driver_runs_the_parallel_collector_and_kryo_unless_told(
    conf: list[str],
    defaults: str | None,
    collectors: list[str],
    serializer: str,
    tmp_path: Path,
) -> None:
    # A fresh process: the JVM's options are fixed when it starts. Its
    # spark-defaults.conf is the test's (an empty folder when none).
    if defaults is not None:
        (tmp_path / "spark-defaults.conf").write_text(defaults, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-c", _JVM_SETTINGS, *conf],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_CONF_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"{collectors!r} {serializer}"


def test_properties_read_as_spark_reads_its_defaults_file() -> None:
    text = (
        "# a comment\n! another\n\n"
        "spark.a 1\n  spark.b=2\nspark.c : two words \n"
        "spark.d -XX:+A \\\n    -XX:+B\nspark.e\n"
    )
    assert properties(text) == {
        "spark.a": "1",
        "spark.b": "2",
        "spark.c": "two words",
        "spark.d": "-XX:+A -XX:+B",
        "spark.e": "",
    }
