"""What machine a benchmark ran on: recorded next to every result."""

from __future__ import annotations

import os
import platform
import sys
import threading
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
    too short-lived for `TreeCpu` to see included: the job's CPU
    when nothing else runs, an upper bound of it otherwise. None without /proc.
    """
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    # cpu  user nice system idle iowait irq softirq steal ...
    busy = [int(fields[i]) for i in (1, 2, 3, 6, 7)]
    return sum(busy) / os.sysconf("SC_CLK_TCK")


class TreeCpu:
    """User + system CPU seconds of process `root` and all its descendants, sampled
    every `every_s` by a thread of its own while in a ``with`` block.

    A Spark job is a Python driver, its JVM and the JVM's Python workers: their
    CPU time, read on a shared machine, says what the job cost where wall time
    says mostly how busy the machine was. A process keeps the CPU it was last
    seen with once it ends, so the count never goes back (reading only the
    processes alive at a stage's end made stages of short-lived workers come
    out negative); one that lives less than `every_s` may be missed. None
    without ``/proc``.
    """

    def __init__(self, root: int, every_s: float = 0.2) -> None:
        self.root = root
        self.every_s = every_s
        self._seen: dict[tuple[int, int], float] = {}  # (pid, start tick) -> CPU seconds
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)

    def __enter__(self) -> TreeCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.seconds()

    def seconds(self) -> float | None:
        """The tree's CPU seconds so far (a fresh sample)."""
        try:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        parent: dict[int, int] = {}
        cpu: dict[int, tuple[int, float]] = {}
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended meanwhile
            parent[pid] = int(fields[1])
            # utime stime (a child's time is its own: reaped, it is not counted twice)
            cpu[pid] = (int(fields[19]), (int(fields[11]) + int(fields[12])) / tick)
        children: dict[int, list[int]] = {}
        for pid, ppid in parent.items():
            children.setdefault(ppid, []).append(pid)
        with self._lock:
            todo = [self.root] if self.root in cpu else []
            while todo:
                pid = todo.pop()
                start, spent = cpu[pid]
                self._seen[(pid, start)] = spent
                todo.extend(children.get(pid, ()))
            return sum(self._seen.values()) if self._seen else None
