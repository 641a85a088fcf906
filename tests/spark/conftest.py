"""Spark test setup: one local SparkSession for every Spark test."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

# pyspark warns at import that it does not yet fully support pandas 3; the job
# itself uses Arrow, not pandas. Import it here, quietly, before test modules.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    import pyspark.testing  # noqa: F401
    from pyspark.sql import SparkSession


def _pandas_on_spark_stand_in() -> None:
    # assertDataFrameEqual imports pyspark.pandas whenever pandas is installed,
    # only to ask whether its arguments are pandas-on-Spark frames. Under
    # pandas 3 that import fails (pyspark 4.x supports pandas < 3), which
    # would break every comparison of plain Spark DataFrames. Where it fails,
    # stand-ins answer "no" to those isinstance checks; nothing else uses them.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            import pyspark.pandas  # noqa: F401
    except ImportError:
        import types

        ps = types.ModuleType("pyspark.pandas")
        ps.DataFrame = type("DataFrame", (), {})  # type: ignore[attr-defined]
        utils = types.ModuleType("pyspark.testing.pandasutils")
        utils.PandasOnSparkTestUtils = type("PandasOnSparkTestUtils", (), {})  # type: ignore[attr-defined]
        sys.modules["pyspark.pandas"] = ps
        sys.modules["pyspark.testing.pandasutils"] = utils


_pandas_on_spark_stand_in()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            # Arrow UDFs re-check the pandas version in the driver.
            item.add_marker(
                pytest.mark.filterwarnings(
                    "ignore:PySpark does not yet fully support:FutureWarning"
                )
            )


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[2], two shuffle partitions, no UI: small data, fast stages."""
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
    yield session
    session.stop()
