"""What machine a benchmark ran on: recorded next to every result."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo ("unknown CPU" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def describe() -> str:
    """Cores, CPU model, memory, Python and kernel, on one line."""
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1048576:.0f} GiB"
                break
    except OSError:
        pass
    system = f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    return f"{os.cpu_count()} cores, {cpu_model()}, {mem} RAM, {system}"
