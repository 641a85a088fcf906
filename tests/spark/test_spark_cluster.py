"""The analysis on a real standalone cluster, through URIs, and its driver files on S3.

* README's ``spark-submit`` recipe, as README writes it but for the cluster's
  address, interpreters, memory sizes and storage URIs, runs on a master and
  two workers whose executors cannot import geofed (the job ships it), with
  every input and output a ``file://`` URI through a symbolic link (driver
  and executors name the folder by a path that is not its real one); its
  results equal a ``local[2]`` run's.
* ``geofed analyze --master spark://...`` survives losing a worker (its
  executor and the checkpoints it held) mid-job, with the same results.
* summary.json and the plots reach an S3-compatible server (moto, on
  loopback) through fsspec, configured by Spark's ``fs.s3a.*`` settings.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from doc_shell import shell_blocks
from spark_cluster import HANG_GUARD_S, Cluster
from spark_helpers import AWS, REPO, message_counts, run, spark_counts, write_jsonl
from test_spark_known import THREE_TRACE

from geofed.bench import WorkloadConfig, generate, write_trace
from geofed.bench.analysis import out_check, storage_options
from geofed.bench.analysis._report import write_driver_files
from geofed.routing import InvalidInput

pytestmark = [pytest.mark.spark, pytest.mark.timeout(1200)]

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small workload in two files of a folder (one without an extension), behind a link."""
    real = tmp_path_factory.mktemp("real")
    (real / "w").mkdir()
    ops = list(generate(WorkloadConfig(scenario="open-data", clients=40, duration_s=6, seed=3)))
    half = len(ops) // 2
    write_trace(ops[:half], real / "w" / "a.jsonl")
    write_trace(ops[half:], real / "w" / "b")
    write_jsonl(real / "w" / "c.jsonl", [*THREE_TRACE, "not json"])
    link = real.parent / (real.name + "-link")
    link.symlink_to(real, target_is_directory=True)
    return {"real": real, "link": link, "uri": f"file://{link}"}


@pytest.fixture(scope="module")
def local_result(spark: Any, data: dict[str, Any]) -> dict[str, Any]:
    result = run(spark, AWS, data["real"] / "w")
    try:
        return {"summary": result.summary, "counts": spark_counts(result)}
    finally:
        result.release()


def _counts(out: Path) -> dict[str, Any]:
    return message_counts(pq.read_table(out / "messages.parquet").to_pylist())


def _same_results(out: Path, local: dict[str, Any]) -> None:
    summary = json.loads((out / "summary.json").read_text())
    for key in ("events", "deliveries", "ops", "strategies", "matrix", "top_topics", "matching"):
        assert summary[key] == local["summary"][key], key
    assert [e["error"] for e in summary["errors"]["shown"]] == [
        e["error"] for e in local["summary"]["errors"]["shown"]
    ]
    assert _counts(out) == local["counts"]


def readme_recipe() -> list[str]:
    """README's spark-submit command, split into words."""
    found = [
        c.text
        for b in shell_blocks(REPO / "README.md")
        for c in b.commands
        if c.text.startswith("spark-submit ")
    ]
    assert len(found) == 1, found
    return shlex.split(found[0])


def test_readme_recipe_on_a_cluster_equals_local(
    cluster: Cluster, data: dict[str, Any], local_result: dict[str, Any], tmp_path: Path
) -> None:
    uri = data["uri"]
    # README's placeholders -> this cluster, this machine, the linked folder.
    swap = {
        "spark://host:7077": cluster.url,
        "spark.pyspark.python=/opt/geofed/.venv/bin/python": (
            f"spark.pyspark.python={cluster.python}"
        ),
        "spark.pyspark.driver.python=/opt/geofed/.venv/bin/python": (
            f"spark.pyspark.driver.python={sys.executable}"
        ),
        "8g": "1g",
        "4g": "768m",
        "hdfs:///traces/w/": f"{uri}/w/",
        "hdfs:///out/analysis": f"{uri}/out",
        "hdfs:///tmp/geofed-checkpoints": f"{uri}/checkpoints",
    }
    words = readme_recipe()
    assert set(swap) <= set(words), "README's recipe changed: update this test's placeholders"
    cmd = [swap.get(w, w) for w in words]
    cmd[0] = str(BIN / "spark-submit")
    proc = subprocess.run(
        [*cmd, "--no-plots"],
        cwd=REPO,
        # The driver's temporary files (the package zip it ships) go here.
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S * 3,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert not list(tmp_path.glob("geofed-pyfiles-*"))  # deleted when the driver ended
    out = data["real"] / "out"  # written through the link
    _same_results(out, local_result)
    summary = json.loads((out / "summary.json").read_text())
    assert all(str(data["link"]) in f for f in summary["workload"]["files"])  # as named, unresolved
    assert summary["workload"]["format"] == "json"  # by content: one file has no extension
    assert not any((data["real"] / "checkpoints").iterdir())  # the job's checkpoints deleted


def test_losing_a_worker_mid_job_changes_nothing(
    cluster: Cluster, data: dict[str, Any], local_result: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    cmd = [
        str(BIN / "geofed"),
        "analyze",
        "--master",
        cluster.url,
        "--driver-memory",
        "1g",
        "--executor-memory",
        "768m",
        "--conf",
        f"spark.pyspark.python={cluster.python}",
        "-f",
        str(AWS),
        "-w",
        f"{data['uri']}/w",
        "-o",
        f"file://{out}",
        "--no-plots",
    ]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    cond = threading.Condition()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with cond:
                lines.append(line)
                cond.notify_all()
        with cond:
            lines.append("<eof>")
            cond.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stage = "subscriptions: ownership, versions, re-homing, segments: done"
    with cond:
        assert cond.wait_for(
            lambda: any(stage in x or x == "<eof>" for x in lines), timeout=HANG_GUARD_S * 2
        )
    assert proc.poll() is None, "".join(lines[-50:])  # mid-job: checkpoints written, more to do
    # Both executors ran tasks by now (two single-core workers, many tasks).
    apps = cluster.status()["activeapps"]
    assert len(apps) == 1
    cluster.kill_worker(1)
    cluster.wait_until(lambda s: cluster.alive(s) == 1, "one worker left")
    stdout = proc.communicate(timeout=HANG_GUARD_S * 3)[0]
    reader.join()
    assert proc.returncode == 0, "".join(lines[-80:])
    assert "written:" in stdout
    _same_results(out, local_result)
    assert not (out / "_checkpoints").exists() or not any((out / "_checkpoints").iterdir())
    # The cluster as the other tests expect it.
    cluster.start_worker()
    cluster.wait_until(lambda s: cluster.alive(s) == 2, "two workers alive again")


@pytest.fixture
def s3() -> Iterator[dict[str, str]]:
    """An S3-compatible server (moto) on a loopback port, with a bucket."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    conf = {
        "spark.hadoop.fs.s3a.endpoint": f"http://{host}:{port}",
        "spark.hadoop.fs.s3a.access.key": "test-key",
        "spark.hadoop.fs.s3a.secret.key": "test-secret",
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.endpoint.region": "us-east-1",
    }
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=conf["spark.hadoop.fs.s3a.endpoint"],
            aws_access_key_id="test-key",
            aws_secret_access_key="test-secret",
            region_name="us-east-1",
        ).create_bucket(Bucket="geofed-out")
        yield conf
    finally:
        server.stop()


def test_driver_files_written_to_s3(spark: Any, tmp_path: Path, s3: dict[str, str]) -> None:
    import s3fs

    result = run(spark, AWS, write_jsonl(tmp_path / "t.jsonl", THREE_TRACE))
    try:
        summary = result.summary
    finally:
        result.release()
    uri = "s3a://geofed-out/runs/one"  # pathlib would make it s3a:/geofed-out/...
    options = storage_options(uri, s3)
    out_check(uri, False, options)  # nothing there yet
    written = write_driver_files(summary, uri, True, options)
    assert written == [f"{uri}/summary.json", f"{uri}/savings.png", f"{uri}/heatmap.png"]
    fs = s3fs.S3FileSystem(**options)
    assert json.loads(fs.cat("geofed-out/runs/one/summary.json")) == json.loads(
        json.dumps(summary, default=str)
    )
    assert fs.cat("geofed-out/runs/one/savings.png")[:4] == b"\x89PNG"
    with pytest.raises(InvalidInput) as err:
        out_check(uri, False, options)  # not empty now
    assert err.value.field == "out" and "--force" in str(err.value)
    out_check(uri, True, options)
