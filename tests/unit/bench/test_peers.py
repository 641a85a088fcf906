"""bench/peers without brokers: the wire counters and the geo-encoded subjects.

The counters cut byte streams into protocol units however TCP splits them;
the geo encoding delivers every event a subscription must get (recall 1 of
the cover), exactly once, before the consumer's exact check.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.bench.brokers import nats_subject
from geofed.bench.peers import (
    Frame,
    GeoEncoding,
    LinkCounts,
    mqtt_frame,
    nats_frame,
    subject_matches,
    tap,
)
from geofed.routing import DecimalLayout, H3Layout, InvalidInput, LatLon, TraceOp, circle, covers


def _mqtt(kind: int, body: bytes) -> bytes:
    n, length = len(body), bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            return bytes([kind << 4, *length]) + body


def _feed(frame: Frame, stream: bytes, seed: int) -> LinkCounts:
    """`stream` both ways of one connection, cut into chunks of any size, interleaved."""
    counts = LinkCounts()
    feed = tap(counts, frame)()
    rng = random.Random(seed)
    at = [0, 0]
    while min(at) < len(stream):
        way = rng.choice([w for w in (0, 1) if at[w] < len(stream)])
        size = rng.randint(1, 50)
        feed(way, stream[at[way] : at[way] + size])
        at[way] += size
    return counts


@pytest.mark.parametrize("seed", range(5))
def test_mqtt_packets_are_counted_however_the_stream_is_cut(seed: int) -> None:
    stream = (
        _mqtt(3, b"t" * 300)  # PUBLISH, a two-byte remaining length
        + _mqtt(8, b"sub")
        + _mqtt(12, b"")  # PINGREQ
        + _mqtt(3, b"")
        + _mqtt(9, b"ack")
    )
    got = _feed(mqtt_frame, stream, seed).snapshot()
    # Both ways: every count twice. PUBLISH: type, 2-byte length, 300 bytes.
    assert got["data"] == (4, 2 * (303 + 2))
    assert got["interest"] == (4, 2 * (5 + 5))
    assert got["other"] == (2, 2 * 2)


@pytest.mark.parametrize("seed", range(5))
def test_nats_lines_and_payloads_are_counted_however_the_stream_is_cut(seed: int) -> None:
    payload = b"a\r\nRS+ fake\r\nb"  # a payload holding protocol-looking bytes
    msg = b"RMSG $G g.x 14\r\n" + payload + b"\r\n"
    hmsg = b"HMSG $G g.y reply 4 6\r\nhh\r\nxx\r\n"
    stream = b"RS+ $G a.b\r\n" + msg + b"PING\r\n" + hmsg + b"RS- $G a.b\r\nA- $G\r\n"
    got = _feed(nats_frame, stream, seed).snapshot()
    assert got["data"] == (4, 2 * (len(msg) + len(hmsg)))
    assert got["interest"] == (6, 2 * (12 + 12 + 7))
    assert got["other"] == (2, 2 * 6)


def test_nats_subjects_of_mqtt_topics_and_filters() -> None:
    assert nats_subject("sensors/fr/+/noise") == "sensors.fr.*.noise"
    assert nats_subject("sensors/#") == "sensors.>"
    for bad in ("a/b.c", "a//b", "a/b c"):
        with pytest.raises(InvalidInput, match="topic"):
            nats_subject(bad)
    assert subject_matches(["a", "*", ">"], ["a", "b", "c", "d"])
    assert not subject_matches(["a", ">"], ["a"])
    assert not subject_matches(["a", "*"], ["a", "b", "c"])


LAYOUTS = [DecimalLayout(prefix="g", decimals=1), H3Layout(prefix="g", resolution=4)]


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    pub=st.tuples(st.floats(40, 55), st.floats(-10, 20)),
    sub=st.tuples(st.floats(40, 55), st.floats(-10, 20)),
    ev_radius=st.one_of(st.none(), st.floats(5_000, 400_000)),
    sub_radius=st.one_of(st.none(), st.floats(5_000, 400_000)),
)
def test_geo_subjects_deliver_what_the_fences_ask_exactly_once(
    layout: DecimalLayout | H3Layout,
    pub: tuple[float, float],
    sub: tuple[float, float],
    ev_radius: float | None,
    sub_radius: float | None,
) -> None:
    enc = GeoEncoding(layout, coverage=0.8, sub_filters=6, ev_filters=3)
    p, s = LatLon(*pub), LatLon(*sub)
    ev_fence = None if ev_radius is None else circle(p, ev_radius)
    sub_fence = None if sub_radius is None else circle(s, sub_radius)
    op = TraceOp(0.0, "publish", "c", p, "e1", "a/b", ev_fence, 10)
    patterns = enc.patterns(enc.sub_cells(sub_fence), enc.ancestors(s), "a/+")
    hits = sum(1 for x in enc.subjects(op) for pat in patterns if subject_matches(pat, x))
    assert hits <= 1  # never twice
    if covers(sub_fence, p) and covers(ev_fence, s):
        assert hits == 1  # recall 1 of the covers
