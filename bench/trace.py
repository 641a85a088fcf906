"""Workload trace files: the one place they are read and written.

A trace is JSON Lines (one client action per line, in time order; see
docs/design.md, "Workload trace"), or Parquet with the same fields as
columns when the path ends in ``.parquet``. Every command that takes a trace
(``simulate``, ``replay``, ``bench``, ``workload``) goes through
`read_trace_file` and `write_trace`; the Spark analysis reads the same two
formats with Spark's own readers. Parquet needs pyarrow (the ``workload`` or
``analysis`` extra).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.routing import (
    DEFAULT_MAX_VERTICES,
    InvalidInput,
    TraceOp,
    op_to_record,
    parse_ops,
    read_trace,
)

COLUMNS = ("t", "op", "client", "lat", "lon", "id", "topic", "geofence", "payload_size", "roaming")
"""The fields of a trace record, and the columns of a Parquet trace."""
OP_ORDER = ("move", "subscribe", "publish", "unsubscribe")
_PARQUET_BATCH = 50_000


@dataclass(frozen=True)
class TraceSummary:
    """What a written trace holds.

    Attributes:
        ops: number of ops by kind.
        clients: number of distinct clients.
        t_first: time of the first op (0 for an empty trace).
        t_last: time of the last op (0 for an empty trace).
    """

    ops: dict[str, int] = field(default_factory=dict)
    clients: int = 0
    t_first: float = 0.0
    t_last: float = 0.0

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {self.ops.get(k, 0)}" for k in OP_ORDER)
        total = sum(self.ops.values())
        return (
            f"{total} ops ({kinds}), {self.clients} clients, t {self.t_first:g}..{self.t_last:g} s"
        )


class _Tally:
    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.clients: set[str] = set()
        self.first: float | None = None
        self.last = 0.0

    def add(self, op: TraceOp) -> None:
        self.ops[op.op] += 1
        self.clients.add(op.client)
        if self.first is None:
            self.first = op.t
        self.last = op.t

    def summary(self) -> TraceSummary:
        return TraceSummary(dict(self.ops), len(self.clients), self.first or 0.0, self.last)


def is_parquet(path: str | Path) -> bool:
    """Whether `path` names a Parquet trace (by its suffix)."""
    return str(path).endswith(".parquet")


def write_trace(ops: Iterable[TraceOp], path: str | Path) -> TraceSummary:
    """Write `ops` as JSON Lines, or as Parquet if `path` ends in ``.parquet``.

    Parquet has the JSON fields as columns (`COLUMNS`); a field an op does not
    have is null. ``-`` writes JSON Lines to standard output.

    Raises:
        InvalidInput: (field ``output``) when the file cannot be written.
    """
    tally = _Tally()
    counted = _counting(ops, tally)
    try:
        if str(path) == "-":
            _write_jsonl(counted, sys.stdout)
        else:
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # the folder named with it
            if is_parquet(path):
                _write_parquet(counted, Path(path))
            else:
                with open(path, "w", encoding="utf-8") as out:
                    _write_jsonl(counted, out)
    except OSError as exc:
        raise InvalidInput("output", f"cannot write {path}: {exc.strerror or exc}") from None
    return tally.summary()


def read_trace_file(
    path: str | Path, *, max_vertices: int = DEFAULT_MAX_VERTICES
) -> Iterator[TraceOp]:
    """Read and validate a JSON Lines or Parquet (``.parquet``) trace, lazily.

    Raises:
        InvalidInput: (field ``workload``) when the file cannot be read, or at
            the first malformed line or row, naming its number and field, or
            a time going backwards.
    """
    try:
        if is_parquet(path):
            yield from parse_ops(_parquet_records(path), max_vertices=max_vertices)
            return
        with open(path, encoding="utf-8") as lines:
            yield from read_trace(lines, max_vertices=max_vertices)
    except FileNotFoundError:
        raise InvalidInput("workload", f"no such file: {path}") from None
    except IsADirectoryError:
        raise InvalidInput("workload", f"{path} is a directory, not a trace file") from None
    except OSError as exc:
        raise InvalidInput("workload", f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(
            "workload",
            f"{path} is not UTF-8 JSON Lines ({exc.reason}); Parquet files end in .parquet",
        ) from None


def read_ops(path: str | Path) -> list[TraceOp]:
    """The whole trace at `path` in memory (see `read_trace_file`)."""
    return list(read_trace_file(path))


def _parquet_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    pq = _pyarrow_parquet()
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid for a non-Parquet file
        if isinstance(exc, OSError) and not type(exc).__module__.startswith("pyarrow"):
            raise
        raise InvalidInput("workload", f"{path} is not a Parquet file: {exc}") from None
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq  # heavy, and an extra: only for Parquet traces
    except ModuleNotFoundError:
        raise InvalidInput(
            "workload",
            "Parquet traces need pyarrow: pip install 'geofed[workload]' (or use JSON Lines)",
        ) from None
    return pq


def _counting(ops: Iterable[TraceOp], tally: _Tally) -> Iterator[TraceOp]:
    for op in ops:
        tally.add(op)
        yield op


def _write_jsonl(ops: Iterable[TraceOp], out: Any) -> None:
    for op in ops:
        out.write(json.dumps(op_to_record(op), separators=(",", ":")))
        out.write("\n")


def _write_parquet(ops: Iterable[TraceOp], path: Path) -> None:
    pq = _pyarrow_parquet()
    import pyarrow as pa

    schema = pa.schema(
        [
            ("t", pa.float64()),
            ("op", pa.string()),
            ("client", pa.string()),
            ("lat", pa.float64()),
            ("lon", pa.float64()),
            ("id", pa.string()),
            ("topic", pa.string()),
            ("geofence", pa.string()),
            ("payload_size", pa.int64()),
            ("roaming", pa.string()),
        ]
    )
    with pq.ParquetWriter(path, schema) as writer:
        # Batches keep memory flat for traces of any length.
        for batch in _batched(ops, _PARQUET_BATCH):
            records = [op_to_record(op) for op in batch]
            columns = {name: [r.get(name) for r in records] for name in COLUMNS}
            writer.write_table(pa.table(columns, schema=schema))


def _batched(items: Iterable[TraceOp], n: int) -> Iterator[list[TraceOp]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, n)):
        yield chunk
