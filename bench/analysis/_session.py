"""The SparkSession the analysis runs in: reused, submitted or local."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from pyspark import SparkConf
from pyspark.sql import SparkSession

APP_NAME = "geofed analyze"


def default_driver_memory() -> str:
    """A third of the machine's RAM, at least 1g and at most 12g (2g if unknown)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "2g"
    # The driver is also the executor in local mode; Python workers and the
    # OS page cache need the rest.
    return f"{max(1, min(12, ram // 3 // (1 << 30)))}g"


def build_session(
    master: str | None, driver_memory: str | None, conf: Sequence[str]
) -> SparkSession:
    """The SparkSession: an active one is reused; otherwise local[*] unless told.

    Under spark-submit the JVM already runs with spark-submit's master and
    memory; only `master` given explicitly overrides it. `conf` items are
    ``KEY=VALUE`` Spark settings.

    Raises:
        ValueError: for a `conf` item that is not ``KEY=VALUE``.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    builder = SparkSession.builder.appName(APP_NAME)
    effective = master or (SparkConf().get("spark.master", "local[*]") if submitted else "local[*]")
    if master or not submitted:
        builder = builder.master(effective)
    if effective.startswith("local"):
        # Python workers run this interpreter (and so find geofed) unless told otherwise.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        if not submitted:
            builder = builder.config(
                "spark.driver.memory", driver_memory or default_driver_memory()
            )
        # Few cores: a few partitions per core; AQE merges what is too small.
        builder = builder.config("spark.sql.shuffle.partitions", str(8 * (os.cpu_count() or 2)))
    builder = (
        builder.config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "true")
        # The job caches intermediate tables; let AQE still size their partitions.
        .config("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning", "true")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "20000")
    )
    for item in conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf: expected KEY=VALUE, got {item!r}")
        builder = builder.config(key, value)
    return builder.getOrCreate()
