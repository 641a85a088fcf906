"""Workload traces (docs/design.md §4): one client action per JSON line, in time order."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ._errors import InvalidInput
from ._geometry import DEFAULT_MAX_VERTICES, Geofence, GeofenceCache, LatLon, latlon
from ._model import validate_id
from ._roaming import Roaming, parse_roaming
from ._topics import validate_filter, validate_topic

OpName = Literal["subscribe", "move", "publish", "unsubscribe"]
OPS: tuple[OpName, ...] = ("subscribe", "move", "publish", "unsubscribe")


@dataclass(frozen=True, slots=True)
class TraceOp:
    """One client action of a workload trace.

    Every action that carries a location first moves the client there (which
    may re-home it to another broker), then performs the action.

    Attributes:
        t: seconds from the start of the trace.
        op: subscribe, move, publish or unsubscribe.
        client: client id.
        location: the client's location (None for unsubscribe).
        id: subscription id (subscribe, unsubscribe) or event id (publish).
        topic: topic filter (subscribe) or topic name (publish).
        geofence: subscription or event geofence; None is the whole world.
        payload_size: payload bytes of a publish.
        line: 1-based line (or row) number in the trace.
        roaming: a subscription's roaming geofence (then `geofence` is None).
    """

    t: float
    op: OpName
    client: str
    location: LatLon | None = None
    id: str = ""
    topic: str = ""
    geofence: Geofence | None = None
    payload_size: int = 0
    line: int = 0
    roaming: Roaming | None = None


def parse_op(record: Mapping[str, Any], line: int, cache: GeofenceCache | None = None) -> TraceOp:
    """Validate one trace record.

    Raises:
        InvalidInput: whose field reads ``line N: <field>``.
    """
    where = f"line {line}"
    cache = cache or GeofenceCache(DEFAULT_MAX_VERTICES)
    if not isinstance(record, Mapping):
        raise InvalidInput(where, "a record must be a JSON object")
    op = record.get("op")
    if op not in OPS:
        raise InvalidInput(f"{where}: op", f"must be one of {', '.join(OPS)}, got {op!r}")
    t = record.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= sys.float_info.max:
        # The upper bound also keeps huge JSON ints out of float() (OverflowError).
        raise InvalidInput(f"{where}: t", f"must be a finite number >= 0, got {t!r}")
    client = validate_id(record.get("client"), f"{where}: client")
    if op == "unsubscribe":
        return TraceOp(
            float(t), op, client, id=validate_id(record.get("id"), f"{where}: id"), line=line
        )
    location = latlon(record.get("lat"), record.get("lon"), where)
    if op == "move":
        return TraceOp(float(t), op, client, location, line=line)
    op_id = validate_id(record.get("id"), f"{where}: id")
    fence = cache.get(record.get("geofence"), f"{where}: geofence")
    roaming = record.get("roaming")
    if roaming is not None and op != "subscribe":
        raise InvalidInput(f"{where}: roaming", "only a subscribe has a roaming geofence")
    if op == "subscribe":
        topic = validate_filter(record.get("topic"), f"{where}: topic")
        if roaming is None:
            return TraceOp(float(t), op, client, location, op_id, topic, fence, line=line)
        if fence is not None:
            raise InvalidInput(
                f"{where}: roaming", "a subscription has a geofence or roaming, not both"
            )
        shape = parse_roaming(roaming, f"{where}: roaming", max_vertices=cache.max_vertices)
        return TraceOp(float(t), op, client, location, op_id, topic, line=line, roaming=shape)
    topic = validate_topic(record.get("topic"), f"{where}: topic")
    size = record.get("payload_size", 0)
    if size is None:
        size = 0
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidInput(f"{where}: payload_size", f"must be an integer >= 0, got {size!r}")
    return TraceOp(float(t), op, client, location, op_id, topic, fence, size, line)


def parse_ops(
    records: Iterable[tuple[int, Any]], *, max_vertices: int = DEFAULT_MAX_VERTICES
) -> Iterator[TraceOp]:
    """Validate numbered trace records (line or row number, record) in time order.

    Raises:
        InvalidInput: at the first malformed record, naming its number and
            field, or a time going backwards.
    """
    cache = GeofenceCache(max_vertices)
    last_t = 0.0
    for n, record in records:
        op = parse_op(record, n, cache)
        if op.t < last_t:
            raise InvalidInput(f"line {n}: t", f"goes back in time ({op.t} < {last_t})")
        last_t = op.t
        yield op


def read_trace(
    lines: Iterable[str], *, max_vertices: int = DEFAULT_MAX_VERTICES
) -> Iterator[TraceOp]:
    """Parse JSON Lines; blank lines are skipped.

    Raises:
        InvalidInput: at the first malformed line, naming its number and field.
    """
    return parse_ops(_json_records(lines), max_vertices=max_vertices)


def _json_records(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"line {n}", f"not JSON: {exc.msg}") from None


def op_to_record(op: TraceOp) -> dict[str, Any]:
    """The JSON object for a trace line (inverse of `parse_op`)."""
    rec: dict[str, Any] = {"t": op.t, "op": op.op, "client": op.client}
    if op.location is not None:
        rec["lat"] = op.location.lat
        rec["lon"] = op.location.lon
    if op.op in ("subscribe", "publish", "unsubscribe"):
        rec["id"] = op.id
    if op.op in ("subscribe", "publish"):
        rec["topic"] = op.topic
        rec["geofence"] = op.geofence.wkt if op.geofence is not None else None
    if op.roaming is not None:
        rec["roaming"] = op.roaming.text
    if op.op == "publish":
        rec["payload_size"] = op.payload_size
    return rec
