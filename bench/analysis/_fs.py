"""Files the analysis reads and writes, wherever they are: local paths or URIs.

Two layers, one rule: what Spark itself reads or writes is looked at
through the JVM's Hadoop FileSystem, so the driver sees exactly what the
executors will (the cluster's connectors, credentials and glob rules); what
the driver process writes on its own (summary.json, the plots) goes through
fsspec, which needs no JVM and no Hadoop connector on the driver.

* `input_files` / `detect_format`: the files behind an input argument
  (file, folder, glob or URI) and whether they are Parquet, by their first
  bytes (``PAR1``), not by their names;
* `out_check`, `write_bytes`: the output folder, through fsspec; Spark's
  ``fs.s3a.*`` settings (`storage_options`) configure it too, so one set of
  settings serves the tables and the files;
* `remove`: deleting a folder Spark wrote (the job's checkpoints).

Paths stay strings: a URI through `pathlib` loses a slash (``s3a://b/o``
becomes ``s3a:/b/o``), and resolving a path on the driver would name what
the driver sees, not what executors see. `join` appends a name.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import SparkSession

from geofed.routing import InvalidInput

PARQUET_MAGIC = b"PAR1"


def join(base: str, name: str) -> str:
    """`base` (a path or URI) with `name` appended, nothing else changed."""
    return base.rstrip("/") + "/" + name if base not in ("", "/") else base + name


def _hidden(name: str) -> bool:
    # Spark's readers skip these too (_SUCCESS, .crc files, _temporary).
    return name.startswith(("_", "."))


def _hadoop(spark: SparkSession, uri: str) -> tuple[Any, Any]:
    """(FileSystem, Path) of the JVM's Hadoop layer for `uri`."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(uri)
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    return path.getFileSystem(conf), path


def input_files(spark: SparkSession, uri: str, what: str) -> list[str]:
    """The data files `uri` names (a file, a folder read recursively, or a glob).

    Raises:
        InvalidInput: naming `what` when nothing is there or the filesystem
            cannot be reached (no connector for the scheme, say).
    """
    try:
        fs, path = _hadoop(spark, uri)
        statuses = fs.globStatus(path)
    except Exception as exc:  # py4j wraps the JVM's IOException and friends
        raise InvalidInput(what, f"{uri}: cannot read: {_jvm_message(exc)}") from None
    if not statuses:
        raise InvalidInput(what, f"{uri}: no such file or directory")
    files: list[str] = []
    for status in statuses:
        if not status.isDirectory():
            files.append(status.getPath().toString())
            continue
        it = fs.listFiles(status.getPath(), True)
        while it.hasNext():
            p = it.next().getPath()
            rel = p.toString()[len(status.getPath().toString()) :]
            if not any(_hidden(part) for part in rel.split("/") if part):
                files.append(p.toString())
    return sorted(files)


def _jvm_message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    for line in text:
        if "Exception:" in line:
            return line.split("Exception:", 1)[1].strip() or line
    return text[0] if text else type(exc).__name__


def _head(spark: SparkSession, uri: str, n: int) -> bytes:
    """The first `n` bytes of a file (fewer if it is shorter)."""
    fs, path = _hadoop(spark, uri)
    stream = fs.open(path)
    try:
        # Byte by byte: a Java byte[] handed over py4j is copied, so read(buf) would
        # fill a copy this side never sees. n is a magic number's length.
        out = bytearray()
        for _ in range(n):
            b = stream.read()
            if b < 0:
                break
            out.append(b)
        return bytes(out)
    finally:
        stream.close()


def detect_format(
    spark: SparkSession, paths: Sequence[str], given: str | None, what: str
) -> tuple[str, list[str]]:
    """(``parquet`` or ``json``, the data files): as given, else by the files' first bytes.

    Raises:
        InvalidInput: naming `what` for a missing input, or one mixing Parquet
            with other files (give the two kinds as separate runs).
    """
    files = [f for p in paths for f in input_files(spark, p, what)]
    if given:
        return given, files
    parquet = [f for f in files if _head(spark, f, len(PARQUET_MAGIC)) == PARQUET_MAGIC]
    if parquet and len(parquet) != len(files):
        other = next(f for f in files if f not in set(parquet))
        raise InvalidInput(
            what, f"mixes Parquet ({parquet[0]}) with other files ({other}); give one kind"
        )
    return ("parquet" if parquet else "json"), files


def remove(spark: SparkSession, uri: str) -> None:
    """Delete `uri` (recursively) through the JVM's Hadoop layer; best effort."""
    try:
        fs, path = _hadoop(spark, uri)
        fs.delete(path, True)
    except Exception:  # cleanup of our own temporary files must not fail the job
        return


# --------------------------------------------------------------------------
# The driver's own files: fsspec

_S3A = {
    "spark.hadoop.fs.s3a.access.key": "key",
    "spark.hadoop.fs.s3a.secret.key": "secret",
    "spark.hadoop.fs.s3a.session.token": "token",
}


def storage_options(uri: str, conf: Mapping[str, str]) -> dict[str, Any]:
    """fsspec options for `uri` taken from Spark settings (``spark.hadoop.fs.s3a.*``).

    For ``s3a://`` and ``s3://`` the endpoint, keys and path-style access that
    Spark's S3A connector is given serve the driver's writes too; other
    schemes use their fsspec implementation's own configuration.
    """
    if not uri.startswith(("s3a://", "s3://")):
        return {}
    opts: dict[str, Any] = {}
    for key, name in _S3A.items():
        if conf.get(key):
            opts[name] = conf[key]
    endpoint = conf.get("spark.hadoop.fs.s3a.endpoint")
    if endpoint:
        if "://" not in endpoint:
            secure = conf.get("spark.hadoop.fs.s3a.connection.ssl.enabled", "true") == "true"
            endpoint = ("https://" if secure else "http://") + endpoint
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    region = conf.get("spark.hadoop.fs.s3a.endpoint.region")
    if region:
        opts.setdefault("client_kwargs", {})["region_name"] = region
    if conf.get("spark.hadoop.fs.s3a.path.style.access") == "true":
        opts["config_kwargs"] = {"s3": {"addressing_style": "path"}}
    return opts


def _fs(uri: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(uri, **options)
    except (ImportError, ValueError) as exc:
        scheme = uri.split("://", 1)[0] if "://" in uri else "file"
        raise InvalidInput(
            "out",
            f"{uri}: the driver cannot write {scheme}:// ({exc}); install the scheme's"
            " fsspec implementation (s3fs for s3a://, gcsfs for gs://, pyarrow for hdfs://)",
        ) from None
    return fs, path


def out_check(uri: str, force: bool, options: Mapping[str, Any]) -> None:
    """Refuse a non-empty output folder unless `force`.

    Raises:
        InvalidInput: naming ``out``: it is not empty, it is a file, or the
            driver has no filesystem for its scheme.
    """
    fs, path = _fs(uri, options)
    try:
        if not fs.exists(path):
            return
        if not fs.isdir(path):
            raise InvalidInput("out", f"{uri} exists and is not a folder")
        if force:
            return
        if fs.ls(path, detail=False):
            raise InvalidInput("out", f"{uri} exists and is not empty (--force writes into it)")
    except OSError as exc:
        raise InvalidInput("out", f"{uri}: {exc}") from None


def write_bytes(uri: str, data: bytes, options: Mapping[str, Any]) -> None:
    """Write one file the driver made (folders are created as needed)."""
    fs, path = _fs(uri, options)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)
