"""The machine facts benchmarks record: CPU seconds of the whole machine and of a
process tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from geofed.bench._machine import TreeCpu, machine_cpu_seconds


def test_machine_cpu_seconds_count_this_process_spinning() -> None:
    before = machine_cpu_seconds()
    assert before is not None and before > 0
    spent = time.process_time()
    while time.process_time() - spent < 0.3:
        pass  # 0.3 s of this process's CPU: the machine's count grows at least by about it
    after = machine_cpu_seconds()
    assert after is not None and after - before >= 0.25


def test_a_process_tree_keeps_the_cpu_of_a_worker_that_ended() -> None:
    """A child forks a worker that spins ~0.5 s and ends; the child ignores SIGCHLD (as
    PySpark's worker daemon does), so the worker's time never reaches its parent's
    count of reaped children. The tree keeps what the worker was last seen with: the
    count grows by about 0.5 s and never goes back (it fell back before)."""
    child_code = """
import os, signal, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # ended children are reaped unseen
pid = os.fork()
if pid == 0:
    t = time.process_time()
    while time.process_time() - t < 0.5:
        pass
    os._exit(0)
try:
    os.waitpid(pid, 0)  # returns once the worker has ended (then: no such child)
except ChildProcessError:
    pass
"""
    with TreeCpu(os.getpid(), every_s=0.02) as tree:
        before = tree.seconds()
        assert before is not None
        subprocess.run([sys.executable, "-c", child_code], check=True)
        samples = [tree.seconds() for _ in range(3)]
    assert all(s is not None for s in samples)
    assert samples == sorted(samples)  # type: ignore[type-var]
    assert samples[-1] - before >= 0.3  # type: ignore[operator]
