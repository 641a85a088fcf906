"""The machine facts benchmarks record: CPU seconds of the whole machine."""

from __future__ import annotations

import time

from geofed.bench._machine import machine_cpu_seconds


def test_machine_cpu_seconds_count_this_process_spinning() -> None:
    before = machine_cpu_seconds()
    assert before is not None and before > 0
    spent = time.process_time()
    while time.process_time() - spent < 0.3:
        pass  # 0.3 s of this process's CPU: the machine's count grows at least by about it
    after = machine_cpu_seconds()
    assert after is not None and after - before >= 0.25
