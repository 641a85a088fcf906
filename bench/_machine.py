"""What machine a benchmark ran on: recorded next to every result."""

from __future__ import annotations

import os
import platform
import sys
import time
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


def record(path: Path, module: str, argv: list[str] | None, body: str, *, title: str = "") -> None:
    """Append a dated section to a results file: the command, the machine, then `body`.

    `title` (the file's heading and introduction) is written first when the
    file is new or empty.
    """
    cmd = f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])
    new = not path.exists() or not path.read_text(encoding="utf-8").strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        if new and title:
            f.write(title)
        f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n")
        f.write(f"Command: `{cmd.strip()}`  \nMachine: {describe()}  \n{body}\n")
