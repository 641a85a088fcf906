"""README's shell examples run as written and print what README shows.

Every ```sh block and every `$ command` line of README.md is a shell command.
Each is either run here, in README order, in one temporary working directory
(so `out/...` paths land there; `deploy/` is linked in from the checkout, as
README's commands run from the checkout's root), with the venv's `geofed` on
PATH -- or it is in NOT_RUN below with the reason. A command that is neither
fails the inventory test, so README cannot gain an unchecked example.

* `$ command` lines: the command runs through bash; exit status 0, and its
  stdout must equal the lines README shows under it, after doc_shell.NORMALISE (the
  documented variable parts) and with a line `...` standing for any lines.
* ```sh blocks: each command runs through bash and must exit 0. The block
  that needs a running federation gets one as README describes: `geofed up`
  starts in the background and the block goes on once it printed "all
  brokers healthy"; `geofed subscribe` (the "other shell") starts in the
  background and the block goes on once it printed "subscribed"; the first
  command after the `geofed publish` commands waits for the subscribers to
  exit 0 (`--count`: they received their deliveries), and at the end the
  test stops `up` with SIGTERM and waits for it to exit 0. MQTT examples:
  `$EU`, `$US`, ... are the ports of `up`'s `mqtt` column (broker id in
  capitals), as README says; `mosquitto_sub` (with `-C`, its count) starts in
  the background and the block goes on once the brokers' metrics hold one
  more local subscription; `mosquitto_pub` counts as a publish.
* Plain ``` blocks without `$` lines are output or text; they must not hold
  anything that looks like a command (use ```sh, or ```text for a synopsis).

Everything waits on state (lines printed, processes ended), not on sleeps.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from doc_shell import (
    HANG_GUARD_S,
    Block,
    Command,
    check_inventory,
    check_transcript,
    run,
    shell_blocks,
)

from geofed.bench import metric
from geofed.node import SUBSCRIPTIONS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the venv's bin: `geofed` lives here

# README commands that CI does not run, each with the reason. Keys are the
# command as README writes it (continuation lines joined, a trailing `# ...`
# comment dropped, runs of blanks collapsed to one).
NOT_RUN: dict[str, str] = {
    # Set-up: these are the whole job and the whole suite, minutes each.
    "make demo": "21 brokers x 4 strategies, about 5 minutes; tests/integration/"
    "test_bench_smoke.py runs geofed bench on a small preset",
    "make test": "the whole test suite, this test included (10-11 minutes)",
    # geofed bench: a fresh federation and a timed replay per strategy, minutes each.
    "geofed bench --scenario mobile --clients 100 --duration 60 --out out/bench/mobile": (
        "4 strategies x a 60 s replay on 21 brokers plus a Spark analysis: minutes"
    ),
    "geofed bench --workload my-trace.jsonl --out out/bench/mine": (
        "placeholder input (your own trace); a full bench run takes minutes"
    ),
    "geofed bench --scenario global --barrier --wan off --out out/bench/exact": (
        "the `make demo` run (barrier after every action): about 5 minutes"
    ),
    # geofed analyze: forms of the command with placeholder inputs; the
    # `$ geofed analyze ...` transcript below them runs the first form for real.
    "geofed analyze -f deploy/federations/aws-2020.geojson -w trace.jsonl -o out/analysis": (
        "placeholder trace.jsonl; the transcript after it runs this form on a real trace"
    ),
    "geofed analyze -f fed.geojson -w trace.parquet -n traces/*.jsonl -o out/measured": (
        "placeholder files (fed.geojson, trace.parquet, node traces)"
    ),
    "python -m geofed.bench.analyze ...": "`...` stands for geofed analyze's arguments",
    "spark-submit --master spark://host:7077 "
    "--conf spark.pyspark.python=/opt/geofed/.venv/bin/python "
    "--conf spark.pyspark.driver.python=/opt/geofed/.venv/bin/python "
    "--driver-memory 8g --executor-memory 4g "
    "bench/analyze.py -f deploy/federations/aws-2020.geojson -w hdfs:///traces/w/ "
    "-o hdfs:///out/analysis --checkpoint-dir hdfs:///tmp/geofed-checkpoints": (
        "needs a Spark cluster and HDFS: tests/spark/test_spark_cluster.py runs this command"
        " on a standalone cluster it starts, with file:// URIs for the hdfs:// ones"
    ),
}


class Background:
    """A command running in the background; its output lines are collected as they come."""

    def __init__(self, cmd: Command, cwd: Path, env: dict[str, str]) -> None:
        self.cmd = cmd
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.proc = subprocess.Popen(
            ["bash", "-c", "exec " + cmd.text],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.readers = [
            threading.Thread(target=self._read, args=(s,), daemon=True)
            for s in (self.proc.stdout, self.proc.stderr)
        ]
        self.open_streams = len(self.readers)
        for t in self.readers:
            t.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.open_streams -= 1
            self.cond.notify_all()

    def wait_for(self, needle: str) -> None:
        """Until a line holds `needle`; fails if the command ends first."""
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(needle in x for x in self.lines) or self.open_streams == 0,
                timeout=HANG_GUARD_S,
            )
            found = any(needle in x for x in self.lines)
        assert ok and found, f"{self.cmd.where}: no {needle!r} from {self.cmd.text}:\n" + (
            "\n".join(self.lines)
        )

    def finish(self) -> int:
        rc = self.proc.wait(timeout=HANG_GUARD_S)
        self._close()
        return rc

    def _close(self) -> None:
        for t in self.readers:
            t.join()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def kill(self) -> None:
        """Ends the command if it still runs (after a failure).

        SIGTERM first: `geofed up` then stops its brokers, which run in
        sessions of their own and would outlive a SIGKILL of `up`.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._close()


def _finish_subscribers(subscribers: list[Background]) -> None:
    """Wait for each subscriber to exit after its --count deliveries."""
    for sub in subscribers:
        rc = sub.finish()
        assert rc == 0, f"{sub.cmd.where}: exited {rc}:\n" + "\n".join(sub.lines)


def _up_brokers(up: Background) -> list[dict[str, str]]:
    """The broker rows of `geofed up`'s table, by its column names (broker, mqtt, metrics...)."""
    with up.cond:
        rows = [x.split() for x in up.lines]
    head = next(r for r in rows if r[:1] == ["broker"])
    return [
        dict(zip(head, r, strict=True))
        for r in rows
        if len(r) == len(head) and r != head and r[-1].startswith("http")
    ]


def _local_subscriptions(up: Background) -> float:
    return sum(metric(row["metrics"], SUBSCRIPTIONS, scope="local") for row in _up_brokers(up))


def _wait_subscribed(up: Background, before: float, sub: Background) -> None:
    """Until the brokers hold one more local subscription (`sub` must not end first)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while _local_subscriptions(up) <= before:
        assert sub.proc.poll() is None, f"{sub.cmd.where}: ended:\n" + "\n".join(sub.lines)
        assert time.monotonic() < deadline, f"{sub.cmd.where}: not subscribed"
        time.sleep(0.05)


def _run_sh_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    up: Background | None = None
    subscribers: list[Background] = []
    try:
        for cmd in block.commands:
            if cmd.key in NOT_RUN:
                continue
            words = shlex.split(cmd.key)
            if words[:2] == ["geofed", "up"]:
                up = Background(cmd, cwd, env)
                up.wait_for("all brokers healthy")
                ports = {r["broker"].upper(): r["mqtt"].rsplit(":", 1)[1] for r in _up_brokers(up)}
                env = {**env, **ports}  # $EU, $US, ...: the mqtt column
            elif words[0] == "mosquitto_sub":
                assert up is not None and "-C" in words, (
                    f"{cmd.where}: mosquitto_sub runs beside `geofed up`, with -C to end"
                )
                before = _local_subscriptions(up)
                sub = Background(cmd, cwd, env)
                subscribers.append(sub)
                _wait_subscribed(up, before, sub)
            elif words[:2] == ["geofed", "subscribe"]:
                assert "--count" in words, (
                    f"{cmd.where}: a subscribe in an example needs --count to end"
                )
                sub = Background(cmd, cwd, env)
                subscribers.append(sub)
                sub.wait_for("subscribed")
            else:
                if words[:2] != ["geofed", "publish"] and words[0] != "mosquitto_pub":
                    _finish_subscribers(subscribers)  # they got their events
                run(cmd, cwd, env)
        _finish_subscribers(subscribers)
        if up is not None:
            up.proc.send_signal(signal.SIGTERM)
            rc = up.finish()
            assert rc == 0, f"{up.cmd.where}: exited {rc} on SIGTERM:\n" + "\n".join(up.lines)
    finally:
        for bg in [*subscribers, *([up] if up else [])]:
            bg.kill()


def test_every_shell_command_is_run_or_listed() -> None:
    """Every README command is run by the test below or listed in NOT_RUN with a reason."""
    check_inventory(shell_blocks(README), NOT_RUN)


# Every README example in turn (a local federation, a Spark job among them): on a
# machine with both cores busy the whole walk can take longer than one test's default.
@pytest.mark.timeout(1200)
def test_shell_examples_run_as_written(tmp_path: Path) -> None:
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")  # README runs from the checkout's root
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    for block in shell_blocks(README):
        if block.kind == "sh":
            _run_sh_block(block, tmp_path, env)
        else:
            check_transcript(block, tmp_path, env, NOT_RUN)
