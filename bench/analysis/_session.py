"""The SparkSession the analysis runs in: reused, submitted, local or on a cluster.

On a cluster the executors need the ``geofed`` package; `build_session`
ships the driver's copy of it (a zip of the imported package, added with
`SparkContext.addPyFile`) rather than relying on one installed at some path
on every machine, so driver and executors may see the project at different
paths, or executors not at all. The executors' Python (``spark.pyspark.python``)
must hold geofed's dependencies (shapely, h3, pyarrow, numpy, grpcio, ...):
an environment installed on every worker, or one packed and sent with
``--archives`` (README.md, section "Analysis").
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from pyspark import SparkConf
from pyspark.sql import SparkSession

APP_NAME = "geofed analyze"
LOCAL_JAVA_OPTIONS = "-XX:+UseParallelGC"
"""The driver JVM's options when this process starts it for a local master (a user's
``spark.driver.extraJavaOptions`` replaces them)."""


def default_driver_memory() -> str:
    """A third of the machine's RAM, at least 1g and at most 12g (2g if unknown)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "2g"
    # The driver is also the executor in local mode; Python workers and the
    # OS page cache need the rest.
    return f"{max(1, min(12, ram // 3 // (1 << 30)))}g"


def is_local(master: str | None) -> bool:
    """A local master: driver and executors are this machine's processes."""
    return (master or "local").startswith("local")


def package_zip(folder: str | None = None) -> str:
    """A zip of the imported ``geofed`` package (its sources, links followed), for executors.

    Written into `folder`, or by default into a new temporary folder that is
    deleted when this process ends: `SparkContext.addPyFile` serves the file
    from where it lies for as long as the context lives. Returns its path.
    """
    import geofed

    root = Path(geofed.__file__).parent
    if folder is None:
        folder = tempfile.mkdtemp(prefix="geofed-pyfiles-")
        atexit.register(shutil.rmtree, folder, True)
    target = Path(folder) / "geofed.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".pyc", ".pyo")):
                    continue
                path = Path(dirpath) / name
                zf.write(path, Path("geofed") / path.relative_to(root))
    return str(target)


def spark_defaults() -> dict[str, str]:
    """The settings of the spark-defaults.conf that spark-submit reads when this process
    starts Spark: in ``$SPARK_CONF_DIR``, else in the ``conf`` folder of ``$SPARK_HOME``
    (else of the pyspark install). Empty when there is none.
    """
    folder = os.environ.get("SPARK_CONF_DIR")
    if folder is None:
        import pyspark

        home = os.environ.get("SPARK_HOME") or str(Path(pyspark.__file__).parent)
        folder = os.path.join(home, "conf")
    try:
        text = (Path(folder) / "spark-defaults.conf").read_text(encoding="utf-8")
    except OSError:
        return {}
    return properties(text)


def properties(text: str) -> dict[str, str]:
    """Key-value pairs of a Java properties file, as far as Spark's files use them:
    ``key value``, ``key=value`` or ``key: value``, ``#`` and ``!`` comments, a
    backslash at the end of a line continuing it. Values are trimmed, as Spark does."""
    out: dict[str, str] = {}
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.lstrip()
        if not line or line[0] in "#!":
            continue
        while (len(line) - len(line.rstrip("\\"))) % 2:  # an odd run of backslashes
            line = line[:-1] + next(lines, "").lstrip()
        key = re.split(r"[\s=:]", line, maxsplit=1)[0]
        value = line[len(key) :].lstrip()
        out[key] = (value[1:] if value[:1] in ("=", ":") else value).strip()
    return out


def build_session(
    master: str | None,
    driver_memory: str | None,
    conf: Sequence[str],
    *,
    executor_memory: str | None = None,
) -> SparkSession:
    """The SparkSession: an active one is reused; otherwise local[*] unless told.

    Under spark-submit the JVM already runs with spark-submit's master and
    memory; only `master` given explicitly overrides it. Otherwise this
    process starts the driver JVM, with `driver_memory` (default: a third
    of RAM for a local master, Spark's own for a cluster) and, for a local
    master, `LOCAL_JAVA_OPTIONS`. On a cluster master the executors run
    ``spark.pyspark.python`` (default: the PYSPARK_PYTHON variable, else
    this interpreter's absolute path) and get this process's geofed package
    (`package_zip`). Each of these defaults, and the job's other Spark
    settings, yields to a value spark-submit was given or a
    spark-defaults.conf sets (`spark_defaults`); `driver_memory`,
    `executor_memory` and `conf` items (``KEY=VALUE`` Spark settings) win
    over everything.

    Raises:
        ValueError: for a `conf` item that is not ``KEY=VALUE``.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    # What the user has set already: spark-submit's settings (its flags and
    # its spark-defaults.conf), or the spark-defaults.conf that the JVM this
    # process starts will read. The defaults below yield to them; `conf`
    # items win over both.
    user = dict(SparkConf().getAll()) if submitted else spark_defaults()
    builder = SparkSession.builder.appName(APP_NAME)

    def default(key: str, value: str) -> None:
        nonlocal builder
        if key not in user:
            builder = builder.config(key, value)

    effective = master or user.get("spark.master", "local[*]")
    if master or not submitted:
        builder = builder.master(effective)
    local = effective.startswith("local")
    if not submitted:
        if driver_memory:
            builder = builder.config("spark.driver.memory", driver_memory)
        elif local:
            default("spark.driver.memory", default_driver_memory())
        if local:
            # The driver JVM does the executors' work too: a batch job, where
            # the throughput collector costs ~5 % fewer CPU seconds than the
            # default G1 (bench/results/spark.md). Executors on a cluster keep
            # Spark's default (their heaps may be large: long full pauses).
            default("spark.driver.extraJavaOptions", LOCAL_JAVA_OPTIONS)
    if executor_memory:
        builder = builder.config("spark.executor.memory", executor_memory)
    if local:
        # Python workers run this interpreter (and so find geofed) unless told otherwise.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        # Few cores: a few partitions per core; AQE merges what is too small.
        default("spark.sql.shuffle.partitions", str(8 * (os.cpu_count() or 2)))
    else:
        # An absolute path: a relative one would be looked up in each
        # executor's work folder.
        default("spark.pyspark.python", os.environ.get("PYSPARK_PYTHON") or sys.executable)
    # The job's checkpoints are written with it: Kryo writes rows for fewer
    # CPU seconds than Java serialization (bench/results/spark.md).
    default("spark.serializer", "org.apache.spark.serializer.KryoSerializer")
    default("spark.ui.showConsoleProgress", "false")
    default("spark.sql.adaptive.enabled", "true")
    # The job caches intermediate tables; let AQE still size their partitions.
    default("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning", "true")
    default("spark.sql.execution.arrow.maxRecordsPerBatch", "20000")
    default("spark.checkpoint.compress", "true")
    for item in conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf: expected KEY=VALUE, got {item!r}")
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if not is_local(spark.sparkContext.master):
        spark.sparkContext.addPyFile(package_zip())
    return spark
