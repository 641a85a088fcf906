"""The adaptive controller: its predictions are the cost model's, its switches are damped."""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from routing_testkit import tiling_federation, workloads

from geofed.routing import (
    STRATEGIES,
    AdaptiveConfig,
    AdaptiveController,
    LatLon,
    TraceOp,
    predict,
)

FED = tiling_federation()
A = LatLon(10.0, 0.0)  # broker a
B = LatLon(10.0, 100.0)  # broker b
C = LatLon(10.0, -100.0)  # broker c


def keyed(ops: list[TraceOp]) -> list[TraceOp]:
    """Two keys: subscriptions s0, s2 and even events on ``x``, the rest on ``y``.

    A subscription id keeps its key through updates, so each key's actions
    form a trace of their own.
    """
    out = []
    for op in ops:
        if op.op in ("subscribe", "publish"):
            out.append(dataclasses.replace(op, topic=f"{_key(op.id)}/{op.topic}"))
        else:
            out.append(op)
    return out


def _key(op_id: str) -> str:
    return "x" if int(op_id[1:]) % 2 == 0 else "y"


def only(key: str, ops: list[TraceOp]) -> list[TraceOp]:
    """The key's own trace: its actions, and every other action's location as a move."""
    out = []
    for op in ops:
        if op.op == "move" or _key_of(op) == key:
            out.append(op)
        elif op.location is not None:
            out.append(TraceOp(op.t, "move", op.client, op.location))
    return out


def _key_of(op: TraceOp) -> str:
    return _key(op.id) if op.id[1:].isdigit() else "-"


@settings(max_examples=60, deadline=None)
@given(ops=workloads(max_ops=30), width=st.sampled_from([1.0, 3.0, 7.0, 100.0]))
def test_window_predictions_add_up_to_predict_of_each_key(ops: list[TraceOp], width: float) -> None:
    ops = keyed(ops)
    config = AdaptiveConfig(window_s=width, candidates=tuple(STRATEGIES))
    ctl = AdaptiveController(FED, config, default="event-geofence", pinned={})
    totals: Counter[tuple[str, str]] = Counter()
    lower: Counter[str] = Counter()
    for _end, reports, _switches in ctl.run(ops):
        for r in reports:
            for name, n in r.predicted.items():
                totals[r.key, name] += n
            lower[r.key] += r.lower_bound
    for key in ("x", "y"):
        mine = only(key, ops)
        for name in STRATEGIES:
            whole = predict(FED, name, mine)
            assert totals[f"{key}/#", name] == whole.total_messages, (key, name)
        assert lower[f"{key}/#"] == predict(FED, "event-geofence", mine).lower_bound_total
