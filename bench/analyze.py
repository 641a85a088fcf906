"""``geofed analyze``: the Spark job measuring what each routing strategy costs.

Runs as a subcommand of the ``geofed`` CLI, as ``python -m geofed.bench.analyze``
and as a plain Spark application::

    geofed analyze -f deploy/federations/aws-2020.geojson -w trace.jsonl -o out/
    geofed analyze --master spark://host:7077 -f fed.geojson -w hdfs:///w/ -o hdfs:///out/
    spark-submit --master spark://host:7077 bench/analyze.py -f fed.geojson -w s3a://b/w/ -o s3a://b/o

This module only parses arguments; the session, the job and its output are
`geofed.bench.analysis` (the ``analysis`` extra), imported when the command
runs so that ``geofed --help`` and the broker never import pyspark. See
README.md, section "Analysis" for inputs, outputs and the node message trace
format.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from geofed.routing import GeofedError

_PROG = "geofed analyze"


def register(subparsers: Any, name: str) -> argparse.ArgumentParser:
    """Add the ``analyze`` subcommand (called `name`) to an argparse subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="analyze inter-region messages per routing strategy (Spark)",
        description=(
            "What-if analysis of a workload trace under every routing strategy, and the"
            " measured comparison with node message traces (PySpark)."
        ),
    )
    _arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--federation", required=True, help="federation file (GeoJSON) or bundled name"
    )
    parser.add_argument(
        "-w",
        "--workload",
        required=True,
        nargs="+",
        metavar="PATH",
        help="workload trace files or folders (JSON Lines, or Parquet)",
    )
    parser.add_argument(
        "-n",
        "--node-trace",
        nargs="+",
        default=[],
        metavar="PATH",
        help="node message trace files or folders (JSON Lines, or Parquet)",
    )
    parser.add_argument(
        "-o",
        "--out",
        required=True,
        help="output folder or URI (created; an existing non-empty one needs --force)",
    )
    parser.add_argument(
        "--force", action="store_true", help="write into a non-empty --out (files replaced)"
    )
    parser.add_argument(
        "--master", help="Spark master URL (default local[*]; spark-submit's when submitted)"
    )
    parser.add_argument(
        "--workload-format", choices=("json", "parquet"), help="default: by the files' content"
    )
    parser.add_argument(
        "--node-format", choices=("json", "parquet"), help="default: by the files' content"
    )
    parser.add_argument(
        "--h3-res", type=int, help="H3 resolution of the spatial join (default: by geofence size)"
    )
    parser.add_argument(
        "--max-errors", type=int, default=100, help="malformed rows listed (all are counted)"
    )
    parser.add_argument(
        "--driver-memory",
        help="driver JVM heap when this process starts Spark"
        " (default: local master: a third of RAM, <= 12g; cluster: Spark's)",
    )
    parser.add_argument("--executor-memory", help="executor JVM heap (cluster masters)")
    parser.add_argument(
        "--checkpoint-dir",
        metavar="URI",
        help="folder for the job's checkpoints, reachable by every executor"
        " (default: local master: a temporary folder; cluster: OUT/_checkpoints);"
        " the job's files there are deleted at the end",
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Spark configuration (repeatable)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def run(args: argparse.Namespace) -> int:
    """Run the analysis; 0 on success, 2 for invalid input (named on stderr)."""
    from geofed.bench._extras import require

    require("analysis", "geofed analyze", "pyspark", "pyarrow", "h3", "matplotlib", "fsspec")
    from pyspark.sql import SparkSession

    from geofed.bench.analysis import (
        AnalysisConfig,
        Progress,
        analyze,
        build_session,
        is_local,
        join,
        load_federation,
        out_check,
        print_table,
        storage_options,
        write_outputs,
    )

    try:
        cfg = AnalysisConfig(
            federation=args.federation,
            workload=tuple(args.workload),
            node_traces=tuple(args.node_trace),
            workload_format=args.workload_format,
            node_format=args.node_format,
            h3_res=args.h3_res,
            max_errors=args.max_errors,
            checkpoint_dir=args.checkpoint_dir,
        )
        # Fail fast, before a JVM starts, on what can be checked without one.
        load_federation(cfg.federation)
        for p in (*cfg.workload, *cfg.node_traces):
            if "://" not in p and not Path(p).exists():
                print(f"{_PROG}: error: {p}: no such file or directory", file=sys.stderr)
                return 2
        settings = dict(item.partition("=")[::2] for item in args.conf)
        options = storage_options(args.out, settings)
        out_check(args.out, args.force, options)
    except GeofedError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2

    owned = SparkSession.getActiveSession() is None
    spark = build_session(
        args.master, args.driver_memory, args.conf, executor_memory=args.executor_memory
    )
    if cfg.checkpoint_dir is None and not is_local(spark.sparkContext.master):
        # Executors elsewhere cannot reach a temporary folder of the driver;
        # the output folder is one they write anyway.
        cfg = replace(cfg, checkpoint_dir=join(args.out, "_checkpoints"))
    progress = Progress(spark)
    result = None
    try:
        result = analyze(spark, cfg, progress)
        with progress.stage("writing outputs"):
            files = write_outputs(
                result, args.out, plots=not args.no_plots, storage_options=options
            )
        print_table(result.summary, sys.stdout)
        print(f"\nwritten: {', '.join(files)}")
        return 0
    except GeofedError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
        if result is not None:
            result.release()
        if owned:
            spark.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m geofed.bench.analyze`` and ``spark-submit bench/analyze.py``."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="What-if analysis of a workload trace under every routing strategy (PySpark).",
    )
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
