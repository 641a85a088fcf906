"""``geofed bench``: the four routing strategies head to head on a live federation.

For each strategy: start a fresh local federation (one ``geofed node`` process
per broker, WAN latency emulated between them), replay one workload through
real gRPC clients, then read what happened from the nodes (Prometheus metrics:
messages, bytes, queue drops, CPU seconds), from the replay client (deliveries,
latencies, throughput) and from the node message traces (through the Spark
analysis, ``geofed analyze``, run once over every strategy's traces). The
report folder (``--out``) holds ``report.md``, ``report.json`` and PNG plots
only; logs, traces, delivery logs and Spark's Parquet tables stay in
``--workdir``.

Timing. By default the replay honours each action's ``t`` (scaled by
``--speed``), so inter-region latency, throughput and CPU reflect a paced,
realistic load. The price is that recall and precision are *measured*, not
guaranteed: with WAN delays a subscription may not have reached a remote
broker yet when an event for it is published there (recall), an event still
in flight may meet a subscription made after it was published (precision),
and a moving client's renewed subscriptions take a one-way delay to spread.
``--barrier`` instead waits after every action until no inter-broker
message is in flight (and replays as fast as the barrier allows):
deliveries and messages are then exact (recall = precision = 1, messages =
cost model), and the exit status says whether they were; throughput in
that mode measures the barrier, not the federation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from geofed.cli.progress import bar as progress_bar
from geofed.cli.progress import enabled as progress_enabled
from geofed.routing import (
    STRATEGIES,
    Federation,
    InvalidInput,
    TraceOp,
    federation_path,
    great_circle_m,
    predict,
    reference_deliveries,
)

from . import _compare_report as rep
from ._extras import require
from ._machine import describe
from .local import LocalFederation
from .replay import Replayer
from .scrape import scrape_all, wait_quiescent
from .trace import read_trace_file, write_trace

# Long enough for a backlog on 21 brokers sharing two cores to drain.
_DRAIN_TIMEOUT_S = 300.0
_BARRIER_TIMEOUT_S = 60.0
_HEARTBEAT_S = 15.0
_OUTPUT_ROOT = "out/bench"
"""Where ``--out`` and ``--workdir`` go by default (``geofed demo``: out/demo)."""


PRESETS: dict[str, dict[str, Any]] = {
    "bench": {},
    # The main job: a small exact run of every strategy, printed as one table.
    "demo": {
        "scenario": "global",
        "clients": 40,
        "duration": 20.0,
        "seed": 7,
        "wan": "off",
        "barrier": True,
        "analysis": False,
        "plots": False,
        "summary": True,
        "tls": True,
        "output_root": "out/demo",
    },
}
"""Subcommands of this pipeline and the defaults each changes (``geofed demo`` is a preset)."""
_HELP = {
    "bench": "routing strategies head to head on a live local federation (report folder)",
    "demo": "the main job: a live 21-region federation under each strategy, exact, one table",
}


def register(subparsers: Any, name: str) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand, or a preset of it (`PRESETS`), called `name`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=_HELP[name],
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--federation", default="aws-2020", help="file or bundled name (default: aws-2020)"
    )
    p.add_argument(
        "--strategy",
        action="append",
        choices=list(STRATEGIES),
        help="repeatable; default: all four",
    )
    p.add_argument(
        "--wan",
        default="model",
        metavar="model|off|FILE",
        help="emulated inter-broker latency: 'model' (per km between the brokers' sites,"
        " default), 'off', or a JSON matrix file {src: {dst: ms}}",
    )
    p.add_argument(
        "--wan-ms-per-km",
        type=float,
        help="one-way delay per km for --wan model (node default 0.021)",
    )
    p.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="mutual TLS between the brokers and TLS to their clients, on a throw-away CA"
        + (" (default: on)" if PRESETS[name].get("tls") else " (default: off)"),
    )
    w = p.add_argument_group("workload (a trace file, or generated)")
    w.add_argument(
        "--workload", help="workload trace (JSON Lines or Parquet) instead of generating"
    )
    w.add_argument(
        "--scenario", help="context, open-data, mobile, global or mixed (default: mobile)"
    )
    w.add_argument("--clients", type=int, help="clients of the workload (default: 100)")
    w.add_argument("--duration", type=float, help="workload seconds (default: 30)")
    w.add_argument("--seed", type=int, help="random seed of the workload (default: 1)")
    r = p.add_argument_group("replay")
    r.add_argument(
        "--speed",
        type=float,
        help="honour t scaled by this factor (2 = twice as fast); 0 = as fast as possible."
        " Default 1, or 0 with --barrier",
    )
    r.add_argument(
        "--barrier",
        action="store_true",
        help="wait after every action until no inter-broker message is in flight (exact runs)",
    )
    o = p.add_argument_group("output")
    root = PRESETS[name].get("output_root", _OUTPUT_ROOT)
    o.add_argument(
        "--out",
        help=f"report folder (Markdown, JSON, PNG) (default: {root}/report); when that"
        f" exists, a fresh {root}/<timestamp>/report",
    )
    o.add_argument(
        "--workdir",
        help=f"logs, node traces, delivery logs, Spark tables (default: {root}/work); when"
        f" that exists, a fresh {root}/<timestamp>/work",
    )
    o.add_argument(
        "--force",
        action="store_true",
        help="write into an existing non-empty --out / --workdir (files in it replaced)",
    )
    o.add_argument(
        "--analysis",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the Spark analysis of the node traces",
    )
    o.add_argument(
        "--plots", action=argparse.BooleanOptionalAction, default=True, help="write PNG plots"
    )
    o.add_argument(
        "--summary",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="print one compact table instead of the report's first sections",
    )
    o.add_argument("--json", action="store_true", help="print report.json instead of the table")
    p.set_defaults(func=run, **{"output_root": _OUTPUT_ROOT, **PRESETS[name]})
    return p


class _Progress:
    """One line per stage on stderr, with the seconds since the start.

    On a terminal, long stages (the replays) also draw a tqdm bar (see
    `geofed.cli.progress`), redrawn in place; elsewhere (logs, CI) they print
    a line now and then, never a carriage return.
    """

    def __init__(self, out: IO[str] | None = None, prog: str = "geofed bench") -> None:
        self.prog = prog
        self.t0 = time.monotonic()
        self.out = out if out is not None else sys.stderr
        self.tty = progress_enabled(self.out)
        self._bar: Any = None
        self._label = ""

    @property
    def every_s(self) -> float:
        """How often a long stage should report."""
        return 0.5 if self.tty else _HEARTBEAT_S

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()  # left on screen: the stage's last state
            self._bar = None

    def say(self, text: str) -> None:
        self._close_bar()
        print(f"[{self.prog} {time.monotonic() - self.t0:7.1f}s] {text}", file=self.out, flush=True)

    def bar(self, label: str, done: int, total: int, extra: str = "") -> None:
        """Progress of a long stage: `done` of `total` steps."""
        if not self.tty:
            self.say(f"{label}: {done:,}/{total:,}{extra}")
            return
        if self._bar is None or label != self._label:
            self._close_bar()
            self._label = label
            self._bar = progress_bar(
                f"[{self.prog}] {label}", total, unit="action", stream=self.out, leave=True
            )
        self._bar.n = done
        self._bar.set_postfix_str(extra.removeprefix(", "), refresh=False)
        self._bar.refresh()


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and write the report; 0 on success.

    Returns 1 when the Spark analysis failed, or when a ``--barrier`` run was
    not exact (messages differ from the cost model, or recall / precision
    below 1, or duplicates); bad input raises `InvalidInput` (exit 2).
    """
    # SIGTERM (a job scheduler, `timeout`) ends the run as Ctrl-C does, through
    # the `finally` blocks that stop the broker processes: they run in their
    # own sessions and would outlive us.
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave signals alone
        return _run(args)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    _workload_args(args)
    if args.workload and not Path(args.workload).is_file():  # before any folder is made
        raise InvalidInput("workload", f"no such file: {args.workload}")
    if args.analysis:
        require("analysis", "the Spark analysis (skip it: --no-analysis)", "pyspark", "h3")
    if args.plots:
        require("analysis", "the plots (skip them: --no-plots)", "matplotlib")
    progress = _Progress(prog=f"geofed {getattr(args, 'command', None) or 'bench'}")
    load_before = _loadavg()
    code = _code_version()  # now: the tree may change while a long run goes on
    fed_file = federation_path(args.federation)
    federation = Federation.load(fed_file)
    speed = args.speed if args.speed is not None else (0.0 if args.barrier else 1.0)
    if speed < 0:
        raise InvalidInput("speed", f"must be >= 0, got {speed!r}")
    wan_env, wan_text = wan_settings(args.wan, args.wan_ms_per_km, federation)
    strategies = list(dict.fromkeys(args.strategy or STRATEGIES))
    out, workdir = _output_folders(args)
    root = Path(args.output_root)
    if (args.out is None and out != root / "report") or (
        args.workdir is None and workdir != root / "work"
    ):
        progress.say(f"{root}/ holds an earlier run: this one writes to {out.parent}/")
    args.out, args.workdir = str(out), str(workdir)
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)

    ops, workload = _workload(args, workdir / "workload.jsonl")
    progress.say(
        f"workload: {workload['ops']:,} actions, {workload['events']:,} events, "
        f"{workload['subscriptions']:,} subscriptions ({workdir / 'workload.jsonl'})"
    )
    expected = reference_deliveries(ops)
    models = {s: predict(federation, s, ops) for s in STRATEGIES}
    workload["expected_deliveries"] = len(expected)
    progress.say(f"oracle and cost model: {len(expected):,} deliveries expected")

    rows = []
    for name in strategies:
        row = _run_strategy(
            name, fed_file, ops, workdir / name, wan_env, speed, args.barrier, progress, args.tls
        )
        model = models[name]
        kinds = model.by_kind()
        row["model"] = {**{k: int(kinds[k]) for k in rep.KINDS}, "total": model.total_messages}
        row["lower_bound"] = model.lower_bound_total
        row["deliveries"] = rep.accuracy(row.pop("_got"), expected)
        rows.append(row)
        d = row["deliveries"]
        progress.say(
            f"{name}: {row['messages']['total']:,} inter-region messages "
            f"(model {row['model']['total']:,}), recall {d['recall']:.4f} "
            f"precision {d['precision']:.4f}"
        )
    rep.add_comparisons(rows, {s: m.total_messages for s, m in models.items()})

    analysis: dict[str, Any] | None = None
    if args.analysis:
        traces = sorted(
            str(p) for s in strategies for p in (workdir / s / "measured").glob("trace-*.jsonl")
        )
        analysis = _run_analysis(
            fed_file, workdir / "workload.jsonl", traces, workdir, out, progress
        )

    report: dict[str, Any] = {
        "command": _command_line(args, speed),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "description": describe(),
            "load_before": load_before,
            "load_after": _loadavg(),
        },
        "code": code,
        "federation": {"name": args.federation, "file": str(fed_file), "brokers": len(federation)},
        "workload": workload,
        "settings": {
            "wan": wan_text,
            "wan_latency": wan_env.get("GEOFED_WAN_LATENCY", "off"),
            "speed": speed,
            "barrier": args.barrier,
            "tls": args.tls,
        },
        "strategies": rows,
        "analysis": analysis,
    }
    if args.plots:
        with _stage(progress, "plots"):
            report["plots"] = rep.plot(report, out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    text = rep.markdown(report)
    (out / "report.md").write_text(text, encoding="utf-8")
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.summary:
        print(rep.summary(report))
        print(
            f"\nreport: {out / 'report.md'}; logs, node traces, deliveries: {workdir}/"
            " (node traces of the measurement window alone: <strategy>/measured/)"
        )
    else:
        print(text.split("\n## Deliveries", 1)[0].rstrip())
        print(f"\nreport: {out / 'report.md'}")
    progress.say(f"report written to {out}/")
    return _status(report, progress)


def _nonempty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _output_folders(args: argparse.Namespace, now: dt.datetime | None = None) -> tuple[Path, Path]:
    """The report folder and the work folder of this run; nothing is created.

    A folder given explicitly (``--out``, ``--workdir``) that exists and is not
    empty needs ``--force``. A default one (under ``args.output_root``) that
    exists is not reused: the run goes to a fresh timestamped folder beside
    it, ``<root>/<timestamp>/report`` and ``.../work`` (unless ``--force``).

    Raises:
        InvalidInput: naming ``out`` or ``workdir``.
    """
    root = Path(args.output_root)
    force = getattr(args, "force", False)
    for option in ("out", "workdir"):
        given = getattr(args, option)
        if given is not None and not force and _nonempty(Path(given)):
            raise InvalidInput(option, f"{given} exists and is not empty (--force writes into it)")
    out = Path(args.out) if args.out is not None else root / "report"
    workdir = Path(args.workdir) if args.workdir is not None else root / "work"
    taken = (args.out is None and _nonempty(out)) or (args.workdir is None and _nonempty(workdir))
    if taken and not force:
        stamp = (now or dt.datetime.now()).strftime("%Y-%m-%dT%H-%M-%S")
        fresh = root / stamp
        n = 1
        while fresh.exists():
            n += 1
            fresh = root / f"{stamp}-{n}"
        if args.out is None:
            out = fresh / "report"
        if args.workdir is None:
            workdir = fresh / "work"
    return out, workdir


def _status(report: Mapping[str, Any], progress: _Progress) -> int:
    problems = []
    if report["analysis"] and report["analysis"].get("error"):
        problems.append("the Spark analysis failed")
    if report["settings"]["barrier"]:
        for r in report["strategies"]:
            d = r["deliveries"]
            if r["messages"]["total"] != r["model"]["total"]:
                problems.append(f"{r['strategy']}: messages differ from the cost model")
            if d["recall"] != 1.0 or d["precision"] != 1.0 or d["duplicates"]:
                problems.append(f"{r['strategy']}: deliveries differ from the central matcher")
            spark = (report["analysis"] or {}).get("strategies", {}).get(r["strategy"], {})
            if set((spark.get("statuses") or {}).values()) - {"ok"}:
                problems.append(f"{r['strategy']}: node traces differ from the Spark what-if")
    for p in problems:
        progress.say(f"NOT OK: {p}")
    return 1 if problems else 0


@contextlib.contextmanager
def _stage(progress: _Progress, name: str) -> Iterator[None]:
    start = time.monotonic()
    progress.say(f"{name} ...")
    yield
    progress.say(f"{name}: done in {time.monotonic() - start:.1f}s")


# ---------------------------------------------------------------------------
# Inputs


def wan_settings(wan: str, ms_per_km: float | None, fed: Federation) -> tuple[dict[str, str], str]:
    """Node environment for the WAN emulation, and a description for the report."""
    if wan == "off":
        return {}, "off"
    if wan == "model":
        missing = [b.id for b in fed if b.site is None]
        if missing:
            raise InvalidInput(
                "wan", f"'model' needs a site for every broker (none for {', '.join(missing)})"
            )
        per_km = 0.021 if ms_per_km is None else ms_per_km
        if per_km < 0:
            raise InvalidInput("wan_ms_per_km", f"must be >= 0, got {per_km!r}")
        km = [
            great_circle_m(a.site, b.site) / 1000.0  # type: ignore[arg-type]
            for a in fed
            for b in fed
            if a.id < b.id
        ]
        env = {"GEOFED_WAN_LATENCY": "model", "GEOFED_WAN_MS_PER_KM": repr(per_km)}
        span = f"{min(km) * per_km:.0f}–{max(km) * per_km:.0f} ms" if km else "no pairs"
        return env, f"model, {per_km:g} ms/km of great-circle distance (one-way {span})"
    path = Path(wan)
    if not path.is_file():
        raise InvalidInput("wan", f"expected 'model', 'off' or a matrix file; no file {wan!r}")
    try:
        matrix = json.loads(path.read_text(encoding="utf-8"))
        values = [float(v) for row in matrix.values() for v in row.values()]
    except (ValueError, AttributeError, TypeError) as exc:
        raise InvalidInput("wan", f"{wan}: not a JSON matrix {{src: {{dst: ms}}}}: {exc}") from None
    span = f"{min(values):g}–{max(values):g} ms" if values else "empty"
    return {"GEOFED_WAN_LATENCY": str(path.resolve())}, f"matrix {wan} (one-way {span})"


_GENERATED = {"scenario": "mobile", "clients": 100, "duration": 30.0, "seed": 1}
"""The options of a generated workload and their defaults."""


def _workload_args(args: argparse.Namespace) -> None:
    """Refuse generation options beside --workload; fill in their defaults (in place)."""
    preset = PRESETS.get(getattr(args, "command", None) or "bench", {})
    given = [n for n in _GENERATED if getattr(args, n) not in (None, preset.get(n))]
    if args.workload and given:
        raise InvalidInput(given[0], "generates a workload: not used with --workload")
    for name, default in _GENERATED.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _workload(args: argparse.Namespace, path: Path) -> tuple[list[TraceOp], dict[str, Any]]:
    """The ops to replay (generated or read), written to `path` for the Spark job."""
    from .workload import WorkloadConfig, generate

    if args.workload:
        ops = list(read_trace_file(args.workload))
        info: dict[str, Any] = {"file": args.workload, "scenario": None}
    else:
        cfg = WorkloadConfig(
            scenario=args.scenario,
            clients=args.clients,
            duration_s=args.duration,
            seed=args.seed,
        )
        ops = list(generate(cfg))
        info = {
            "file": str(path),
            "scenario": cfg.scenario,
            "seed": cfg.seed,
            "world_share": cfg.effective_world_share,
        }
    write_trace(ops, path)
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.op] = counts.get(op.op, 0) + 1
    info.update(
        {
            "ops": len(ops),
            "by_op": counts,
            "events": counts.get("publish", 0),
            "subscriptions": counts.get("subscribe", 0),
            "clients": len({op.client for op in ops}),
            "duration_s": max((op.t for op in ops), default=0.0),
        }
    )
    return ops, info


def _command_line(args: argparse.Namespace, speed: float) -> str:
    """The command that reproduces this run (effective values, not just the given flags)."""
    cmd = ["geofed", "bench", "--federation", args.federation, "--wan", args.wan]
    if args.wan_ms_per_km is not None:
        cmd += ["--wan-ms-per-km", f"{args.wan_ms_per_km:g}"]
    for s in args.strategy or []:
        cmd += ["--strategy", s]
    if args.workload:
        cmd += ["--workload", args.workload]
    else:
        cmd += ["--scenario", args.scenario, "--clients", str(args.clients)]
        cmd += ["--duration", f"{args.duration:g}", "--seed", str(args.seed)]
    cmd += ["--speed", f"{speed:g}"]
    if args.barrier:
        cmd.append("--barrier")
    root = getattr(args, "output_root", _OUTPUT_ROOT)
    cmd += ["--out", args.out or f"{root}/report", "--workdir", args.workdir or f"{root}/work"]
    if not args.analysis:
        cmd.append("--no-analysis")
    if not args.plots:
        cmd.append("--no-plots")
    return shlex.join(cmd)


def _code_version() -> dict[str, Any]:
    """The git commit of the running code, and whether it had uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout  # "XY path" lines: not stripped, X may be a space
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": None}  # not a git checkout: an installed package
    # Result files are what a run writes, not code.
    code_changes = [ln for ln in changed.splitlines() if not ln[3:].startswith("bench/results/")]
    return {"commit": commit, "modified": bool(code_changes)}


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


# ---------------------------------------------------------------------------
# One strategy on a live federation


def _run_strategy(
    name: str,
    fed_file: Path,
    ops: list[TraceOp],
    workdir: Path,
    wan_env: dict[str, str],
    speed: float,
    barrier: bool,
    progress: _Progress,
    tls: bool = False,
) -> dict[str, Any]:

    _clean(workdir)
    t0 = time.monotonic()
    progress.say(f"{name}: starting the federation{' (TLS)' if tls else ''} ...")
    fed = LocalFederation(fed_file, name, workdir, trace=True, extra_env=wan_env, tls=tls)
    try:
        # Many brokers on few cores start slowly: a generous readiness timeout.
        fed.start(timeout=60.0 + 10.0 * len(fed.source))
        started = time.monotonic() - t0
        progress.say(f"{name}: {len(fed.nodes)} brokers ready in {started:.1f}s; replaying ...")
        urls = fed.metrics_urls()
        before = scrape_all(urls)
        played = asyncio.run(
            _replay(fed, ops, workdir / "deliveries.jsonl", speed, barrier, progress, name)
        )
    finally:
        t_stop = time.monotonic()
        fed.stop()  # SIGTERM: each node flushes and closes its message trace
    _trim_traces(workdir, workdir / "measured", played["cutoff"])
    node = rep.node_totals(before, played["after"])
    return {
        "strategy": name,
        **node,
        "replay": played["replay"],
        "latency_ms": rep.latency_summary(played["latencies"]),
        "_got": played["got"],
        "stages_s": {
            "start": round(started, 2),
            "replay": played["replay"]["seconds"],
            "drain": played["drain_s"],
            "stop": round(time.monotonic() - t_stop, 2),
        },
    }


def _clean(workdir: Path) -> None:
    # Nodes append to their trace and log files: stale ones from an earlier
    # run in the same folder would be counted again by the analysis.
    workdir.mkdir(parents=True, exist_ok=True)
    for pattern in (
        "trace-*.jsonl",
        "measured/trace-*.jsonl",
        "node-*.log",
        "deliveries.jsonl",
        "federation.geojson",
    ):
        for f in workdir.glob(pattern):
            f.unlink()


def _trim_traces(src: Path, dst: Path, cutoff: float) -> None:
    """Copies of the node message traces without the records after `cutoff` (wall clock).

    The measurement window ends when the replay has drained and the metrics
    are read; closing the clients afterwards withdraws their subscriptions,
    and those unsubscribe messages belong to no strategy's cost.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("trace-*.jsonl")):
        with path.open(encoding="utf-8") as f, (dst / path.name).open("w", encoding="utf-8") as out:
            for line in f:
                try:
                    late = float(json.loads(line)["t"]) > cutoff
                except (ValueError, KeyError, TypeError):
                    late = False  # malformed: the analysis reports it with its line number
                if not late:
                    out.write(line)


class _Pacer:
    """Feeds ops to the replayer, counting them and how late they start."""

    def __init__(self, ops: Sequence[TraceOp], speed: float) -> None:
        self.ops = ops
        self.speed = speed
        self.done = 0
        self.max_lag = 0.0
        self.start: float | None = None

    def __iter__(self) -> Iterator[TraceOp]:
        # The replayer takes its start time right before pulling the first op.
        self.start = time.monotonic()
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop: iterated directly
            task = None
        for op in self.ops:
            if task is not None and task.cancelling():
                # Ctrl-C cancels the replay task, but the replayer records a
                # cancelled RPC as a failed action and goes on: stop here.
                raise asyncio.CancelledError
            if self.speed > 0:
                # Pulled once the previous op is done: if that is already past
                # this op's due time, the replay is behind the schedule.
                self.max_lag = max(
                    self.max_lag, time.monotonic() - (self.start + op.t / self.speed)
                )
            yield op
            self.done += 1


async def _replay(
    fed: Any,
    ops: list[TraceOp],
    log_path: Path,
    speed: float,
    barrier: bool,
    progress: _Progress,
    name: str,
) -> dict[str, Any]:

    urls = fed.metrics_urls()
    pacer = _Pacer(ops, speed)
    with log_path.open("w", encoding="utf-8") as log:
        r = Replayer(
            fed.federation,
            log,
            barrier=(lambda: wait_quiescent(urls, timeout=_BARRIER_TIMEOUT_S)) if barrier else None,
            tls=fed.client_tls(),
        )

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(progress.every_s)
                lag = f", {pacer.max_lag:.1f}s behind at most" if speed > 0 else ""
                progress.bar(
                    f"{name}: actions",
                    pacer.done,
                    len(ops),
                    f", {len(r.deliveries):,} deliveries{lag}",
                )

        beat = asyncio.create_task(heartbeat())
        errors: list[str] = []
        try:
            t0 = time.monotonic()
            await r.run(pacer, speed)
            seconds = time.monotonic() - t0
            t1 = time.monotonic()
            try:
                await wait_quiescent(urls, timeout=_DRAIN_TIMEOUT_S)
            except Exception as exc:  # still report what was measured, with the reason
                errors.append(f"not quiescent after the replay: {exc}")
            # Every inter-broker message sent has arrived: the federation has
            # absorbed the load (deliveries to clients may still be on their way).
            drain = time.monotonic() - t1
            await r.settle(urls)
            # Before the streams close: a closed Subscribe stream withdraws its
            # subscription, which would add unsubscribe messages to the count.
            cutoff = time.time()
            after = await asyncio.to_thread(scrape_all, urls)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
            await r.close()
    events = sum(1 for op in ops if op.op == "publish")
    span = max((op.t for op in ops), default=0.0)
    errors += r.errors
    progress.say(
        f"{name}: replayed {len(ops):,} actions in {seconds:.1f}s, drained in {drain:.1f}s"
    )
    return {
        "after": after,
        "cutoff": cutoff,
        "got": list(r.deliveries),
        "latencies": list(r.latencies),
        "drain_s": round(drain, 2),
        "replay": {
            "seconds": round(seconds, 3),
            "events": events,
            "events_per_s": round(events / seconds, 2) if seconds > 0 else None,
            # What the federation absorbed: publishing can outrun forwarding,
            # and the backlog drains after the last action.
            "drain_s": round(drain, 3),
            "sustained_events_per_s": round(events / (seconds + drain), 2)
            if seconds + drain > 0
            else None,
            "offered_events_per_s": round(events * speed / span, 2) if speed and span else None,
            "max_lag_s": round(max(pacer.max_lag, 0.0), 3) if speed > 0 else None,
            "redirects": r.redirects,
            "errors": len(errors),
            "error_samples": errors[:10],
        },
    }


# ---------------------------------------------------------------------------
# Spark


def _run_analysis(
    fed_file: Path,
    workload: Path,
    traces: list[str],
    workdir: Path,
    out: Path,
    progress: _Progress,
) -> dict[str, Any]:
    """``geofed analyze`` in its own process, its summary and plots copied into `out`.

    A separate process keeps the JVM and its memory out of this one, and uses
    the analysis exactly as its users do.
    """
    adir = workdir / "analysis"
    cmd = [sys.executable, "-m", "geofed.bench.analyze", "-f", str(fed_file), "-w", str(workload)]
    if traces:
        cmd += ["-n", *traces]
    cmd += ["-o", str(adir), "--force"]  # our own work folder: an earlier analysis goes
    log_path = workdir / "analysis.log"
    start = time.monotonic()
    progress.say(f"Spark analysis of the workload and {len(traces)} node traces ...")
    with (
        log_path.open("w", encoding="utf-8") as log,
        subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace"
        ) as proc,
    ):
        assert proc.stderr is not None
        for line in proc.stderr:
            log.write(line)
            # The job's own stage lines are the progress; JVM chatter stays in the log.
            if line.startswith("[geofed analyze"):
                progress.say("  " + line.rstrip().split("] ", 1)[-1])
        rc = proc.wait()
    took = time.monotonic() - start
    summary_file = adir / "summary.json"
    if rc != 0 or not summary_file.is_file():
        progress.say(f"Spark analysis failed (exit {rc}); log: {log_path}")
        return {"error": f"geofed analyze exited with {rc}; log: {log_path}", "seconds": took}
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    shutil.copyfile(summary_file, out / "analysis-summary.json")
    for png in ("savings.png", "heatmap.png"):
        if (adir / png).is_file():
            shutil.copyfile(adir / png, out / f"analysis-{png}")
    progress.say(f"Spark analysis: done in {took:.1f}s")
    return {**rep.spark_extract(summary), "seconds": round(took, 1)}
