"""A real Spark standalone cluster on loopback: one master and two workers.

Started from the pyspark install with ``spark-class`` (the pip package has
no sbin scripts), as a user without a Spark distribution would. Waits go on
the master's JSON status page (``/json/``), never on the clock.

The executors run `executor_python`: this venv's interpreter with ``-S`` and
the venv's site-packages on PYTHONPATH. ``-S`` skips the ``.pth`` files, so
the editable geofed install is invisible to them: executors see the
project's dependencies but not the project, which must be shipped by the
job (as on a cluster whose machines hold the project at another path, or
not at all).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyspark

from geofed.bench.local import free_ports

HANG_GUARD_S = 300.0  # only against a hang: every wait is on state


def spark_home() -> Path:
    return Path(pyspark.__file__).parent


def executor_python(folder: Path) -> Path:
    """A wrapper interpreter for executors: the deps of geofed, not geofed itself."""
    site = sysconfig.get_paths()["purelib"]
    path = folder / "executor-python"
    path.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} -S "$@"\n'
    )
    path.chmod(0o755)
    return path


class Cluster:
    """Master and workers as process groups of their own (a worker with its executors)."""

    def __init__(self, root: Path, workers: int = 2) -> None:
        self.root = root
        self.port, self.ui_port = free_ports(2)
        self.url = f"spark://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOG_DIR": str(root / "logs"),
            # Scratch space (executor folders, shuffle files) in the test's own
            # folder: a worker the tests kill leaves its files there, not in /tmp.
            "SPARK_LOCAL_DIRS": str(root / "scratch"),
        }
        self.python = executor_python(root)
        self.master = self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            ["--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port)],
        )
        self.workers: list[subprocess.Popen[bytes]] = []
        for _ in range(workers):
            self.start_worker()
        self.wait_until(lambda s: self.alive(s) == workers, f"{workers} workers alive")

    def _start(self, name: str, cls: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("wb") as log:  # the child keeps its own handle
            return subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), cls, *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # killpg reaches its executors and their Python workers
            )

    def start_worker(self) -> None:
        i = len(self.workers)
        (ui,) = free_ports(1)
        work = self.root / f"work-{i}"
        work.mkdir(exist_ok=True)
        self.workers.append(
            self._start(
                f"worker-{i}",
                "org.apache.spark.deploy.worker.Worker",
                [
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    "1",
                    "--memory",
                    "1g",
                    "--webui-port",
                    str(ui),
                    "--work-dir",
                    str(work),
                    self.url,
                ],
            )
        )

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker `i`, its executor and their Python workers: a machine lost."""
        os.killpg(self.workers[i].pid, signal.SIGKILL)
        self.workers[i].wait()

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=10) as r:
            data: dict[str, Any] = json.load(r)
        return data

    @staticmethod
    def alive(status: dict[str, Any]) -> int:
        return sum(1 for w in status.get("workers", []) if w.get("state") == "ALIVE")

    def wait_until(self, cond: Callable[[dict[str, Any]], bool], what: str) -> None:
        """Until the master's status satisfies `cond` (polled; a dead master fails at once)."""
        done = threading.Event()
        last: dict[str, Any] = {}
        for _ in range(int(HANG_GUARD_S * 4)):
            if self.master.poll() is not None:
                raise AssertionError(f"the master exited: see {self.root}/master.log")
            try:
                last = self.status()
            except OSError:
                last = {}
            if last and cond(last):
                return
            done.wait(0.25)
        raise AssertionError(f"cluster: not {what}: {last}")

    def stop(self) -> None:
        for p in [*self.workers, self.master]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in [*self.workers, self.master]:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
