"""Spark test setup: one local SparkSession for every Spark test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from spark_helpers import RESULTS

_HERE = Path(__file__).resolve().parent
_SESSION: list[SparkSession] = []


def _session() -> SparkSession:
    """local[2], two shuffle partitions, no UI: small data, fast stages."""
    if not _SESSION:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        session = (
            SparkSession.builder.master("local[2]")
            .appName("geofed-spark-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.sql.adaptive.enabled", "true")
            .config("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning", "true")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("ERROR")
        _SESSION.append(session)
    return _SESSION[0]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Launch the JVM before the first test when Spark tests were collected.

    The full suite runs hundreds of gRPC tests in this process before the
    Spark ones; a JVM launched after them once exited before it reported its
    port (pyspark's launch forks this process, whose gRPC threads were busy).
    Launched here, no test has started a gRPC thread yet.
    """
    if any(_HERE in Path(item.path).parents for item in session.items):
        _session()


@pytest.fixture(autouse=True)
def release_results() -> Iterator[None]:
    """Release what `spark_helpers.run` gave a test once it ends: its cached
    tables and checkpoint folder would otherwise outlive the suite."""
    yield
    while RESULTS:
        RESULTS.pop().release()


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The session `pytest_collection_finish` launched (or one launched now)."""
    yield _session()
    _SESSION.pop().stop()
