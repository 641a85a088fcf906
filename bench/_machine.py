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


def machine_cpu_seconds() -> float | None:
    """User + system CPU seconds the whole machine spent so far (all cores, /proc/stat).

    The difference over a run is what every process cost, those that ended
    unreaped included (which `tree_cpu_seconds` cannot see): the job's CPU
    when nothing else runs, an upper bound of it otherwise. None without /proc.
    """
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    # cpu  user nice system idle iowait irq softirq steal ...
    busy = [int(fields[i]) for i in (1, 2, 3, 6, 7)]
    return sum(busy) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float | None:
    """User + system CPU seconds so far of process `root` and all its descendants.

    A Spark job is a Python driver, its JVM and the JVM's Python workers: their
    CPU time, read on a shared machine, says what the job cost where wall
    time says mostly how busy the machine was. Children a member of the tree
    has reaped count too (``cutime``/``cstime``); a process that ended and
    was not reaped inside the tree does not. None without ``/proc``.
    """
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        parent[pid] = int(fields[1])
        cpu[pid] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    if root not in cpu:
        return None
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu[pid]
        todo.extend(children.get(pid, ()))
    return total
