"""The federation file: brokers, their areas, and who is responsible where (docs/design.md §2)."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import shapely
from shapely.geometry import MultiLineString, Point, box
from shapely.geometry.base import BaseGeometry
from shapely.strtree import STRtree

from ._errors import InvalidInput, NotFound
from ._geometry import Geofence, LatLon, _intersects_xy, latlon, parse_geojson
from ._model import validate_id

_WORLD = box(-180.0, -90.0, 180.0, 90.0)
_ANTIMERIDIAN = MultiLineString([[(x, -90.0), (x, 90.0)] for x in (-180.0, 180.0)])
_GAP_TOLERANCE_SQ_DEG = 1e-9
_ROUTE_CACHE_SIZE = 4096
_SCAN_LIMIT = 256  # areas (parts) up to which responsible() scans bounding boxes


@dataclass(frozen=True, eq=False)
class BrokerInfo:
    """One broker as the federation file declares it: id, area, endpoints (data only).

    Attributes:
        id: unique broker id.
        area: the broker area.
        endpoint: ``host:port`` of its federation gRPC port ("" for analysis-only use).
        client_endpoint: ``host:port`` clients connect to ("" if not given).
        site: where the broker itself is, if given.
        name: a human-readable name.
        mqtt_endpoint: ``host:port`` of its MQTT listener ("" if not given): the Server
            Reference of MQTT redirects.
        mqtt_ws_endpoint: ``host:port`` of its MQTT-over-WebSocket listener ("" if not
            given): what redirects name to WebSocket clients (as ``ws[s]://host:port/mqtt``).
        http_endpoint: ``host:port`` of its HTTP bridge ("" if not given): where HTTP
            redirects point and where the web map reads the other brokers' status.
    """

    id: str
    area: Geofence
    endpoint: str = ""
    client_endpoint: str = ""
    site: LatLon | None = None
    name: str = ""
    mqtt_endpoint: str = ""
    mqtt_ws_endpoint: str = ""
    http_endpoint: str = ""


class Federation:
    """The brokers of a federation and the geometry questions routing asks.

    Responsibility (docs/design.md §2): a location covered by one or more areas belongs
    to the smallest covering id; a location covered by none to the nearest area
    (planar distance in degrees, across the antimeridian). If the areas leave
    such a gap, a geofence that meets the gap is routed to every broker, since
    any of them may be responsible for a point of it: exact, but not frugal;
    `geofed areas` produces gap-free federations.
    """

    def __init__(self, brokers: list[BrokerInfo]) -> None:
        if not brokers:
            raise InvalidInput("features", "a federation needs at least one broker")
        self.brokers: tuple[BrokerInfo, ...] = tuple(sorted(brokers, key=lambda b: b.id))
        self.ids: tuple[str, ...] = tuple(b.id for b in self.brokers)
        self._by_id = {b.id: b for b in self.brokers}
        part_geoms: list[BaseGeometry] = []
        self._part_owner: list[int] = []
        for idx, b in enumerate(self.brokers):
            for part in b.area.parts:
                part_geoms.append(part)
                self._part_owner.append(idx)
        self._tree = STRtree(part_geoms)
        self._part_bounds: list[tuple[tuple[float, ...], BaseGeometry, str]] | None = None
        if len(part_geoms) <= _SCAN_LIMIT:
            for g in part_geoms:
                shapely.prepare(g)
            self._part_bounds = [
                (tuple(g.bounds), g, self.brokers[o].id)
                for g, o in zip(part_geoms, self._part_owner, strict=True)
            ]
        union = shapely.union_all([b.area.geometry for b in self.brokers])
        gap = shapely.difference(_WORLD, union)
        self.gap: BaseGeometry | None = None
        if not gap.is_empty and gap.area > _GAP_TOLERANCE_SQ_DEG:
            shapely.prepare(gap)
            self.gap = gap
        # Normalized geometry: the same areas written another way (ring start,
        # orientation, part order) give the same digest.
        canonical = [
            [b.id, shapely.to_wkt(shapely.normalize(b.area.geometry), rounding_precision=-1)]
            for b in self.brokers
        ]
        self.digest = hashlib.sha256(json.dumps(canonical).encode()).hexdigest()
        self._all = frozenset(self.ids)
        self._route_cache: OrderedDict[bytes, frozenset[str]] = OrderedDict()
        # Publishers publish from few places over and over: their owner is looked up once.
        self._owner_cache: dict[tuple[float, float], str] = {}  # (lon, lat) -> owner

    def __len__(self) -> int:
        return len(self.brokers)

    def __iter__(self) -> Iterator[BrokerInfo]:
        return iter(self.brokers)

    def __contains__(self, broker_id: object) -> bool:
        return broker_id in self._by_id

    def broker(self, broker_id: str) -> BrokerInfo:
        """The broker with this id.

        Raises:
            NotFound: if no broker has that id.
        """
        try:
            return self._by_id[broker_id]
        except KeyError:
            raise NotFound("broker", broker_id) from None

    def responsible(self, location: LatLon) -> str:
        """Id of the broker responsible for `location` (its local broker)."""
        # Keyed by a tuple: hashing the dataclass runs its generated `__hash__` in Python.
        key = (location.lon, location.lat)
        owner = self._owner_cache.get(key)
        if owner is None:
            owners = self._owners_at(location.lon, location.lat)
            if abs(location.lon) == 180.0:
                owners |= self._owners_at(-location.lon, location.lat)
            owner = min(owners) if owners else self._nearest(location)
            if len(self._owner_cache) >= _ROUTE_CACHE_SIZE:
                self._owner_cache.clear()  # cheap, and bounded
            self._owner_cache[key] = owner
        return owner

    def _owners_at(self, lon: float, lat: float) -> set[str]:
        if self._part_bounds is None:
            hits = self._tree.query(Point(lon, lat), predicate="intersects")
            return {self.brokers[self._part_owner[int(i)]].id for i in hits}
        # Few brokers: a bounding-box scan beats building a query point.
        out: set[str] = set()
        for (minx, miny, maxx, maxy), part, owner in self._part_bounds:
            if minx <= lon <= maxx and miny <= lat <= maxy and _intersects_xy(part, lon, lat):
                out.add(owner)
        return out

    def _nearest(self, location: LatLon) -> str:
        best: tuple[float, str] | None = None
        for shift in (-360.0, 0.0, 360.0):
            p = Point(location.lon + shift, location.lat)
            for b in self.brokers:
                d = float(b.area.geometry.distance(p))
                if best is None or (d, b.id) < best:
                    best = (d, b.id)
        assert best is not None
        return best[1]

    def brokers_meeting(self, geofence: Geofence | None) -> frozenset[str]:
        """Ids of the brokers that may be responsible for some point of `geofence`.

        Without a gap these are exactly the brokers whose area intersects it;
        ``None`` (the whole world) meets every broker.
        """
        if geofence is None:
            return self._all
        key = geofence.key
        cached = self._route_cache.get(key)
        if cached is not None:
            self._route_cache.move_to_end(key)
            return cached
        if self.gap is not None and geofence.intersects(self.gap):
            result = self._all
        else:
            hits = list(self._tree.query(geofence.geometry, predicate="intersects"))
            seam = shapely.intersection(geofence.geometry, _ANTIMERIDIAN)
            if not seam.is_empty:
                # -180 and 180 are one meridian: a geofence touching it from one
                # side also meets the areas that touch it from the other side.
                mirrored = shapely.transform(seam, lambda xy: xy * (-1.0, 1.0))
                hits.extend(self._tree.query(mirrored, predicate="intersects"))
            result = frozenset(self.brokers[self._part_owner[int(i)]].id for i in hits)
        self._route_cache[key] = result
        if len(self._route_cache) > _ROUTE_CACHE_SIZE:
            self._route_cache.popitem(last=False)
        return result

    def with_endpoints(self, endpoints: Mapping[str, tuple[str, str]]) -> Federation:
        """A copy whose brokers have the given (peer endpoint, client endpoint)."""
        return Federation(
            [
                BrokerInfo(
                    b.id,
                    b.area,
                    *endpoints.get(b.id, (b.endpoint, b.client_endpoint)),
                    b.site,
                    b.name,
                    b.mqtt_endpoint,
                    b.mqtt_ws_endpoint,
                    b.http_endpoint,
                )
                for b in self.brokers
            ]
        )

    def to_geojson(self) -> dict[str, Any]:
        """The federation as a GeoJSON FeatureCollection (docs/design.md §2)."""
        features = []
        for b in self.brokers:
            props: dict[str, Any] = {"id": b.id}
            if b.name:
                props["name"] = b.name
            if b.endpoint:
                props["endpoint"] = b.endpoint
            if b.client_endpoint:
                props["client_endpoint"] = b.client_endpoint
            if b.mqtt_endpoint:
                props["mqtt_endpoint"] = b.mqtt_endpoint
            if b.mqtt_ws_endpoint:
                props["mqtt_ws_endpoint"] = b.mqtt_ws_endpoint
            if b.http_endpoint:
                props["http_endpoint"] = b.http_endpoint
            if b.site is not None:
                props["site"] = [b.site.lon, b.site.lat]
            features.append(
                {
                    "type": "Feature",
                    "geometry": _json_shaped(b.area.geometry.__geo_interface__),
                    "properties": props,
                }
            )
        return {"type": "FeatureCollection", "features": features}

    @classmethod
    def from_geojson(cls, obj: Any, *, source: str = "federation") -> Federation:
        """Build from a parsed GeoJSON FeatureCollection.

        Raises:
            InvalidInput: naming the feature and field that is wrong.
        """
        if not isinstance(obj, dict) or obj.get("type") != "FeatureCollection":
            raise InvalidInput(source, "must be a GeoJSON FeatureCollection")
        features = obj.get("features")
        if not isinstance(features, list) or not features:
            raise InvalidInput(f"{source}.features", "must be a non-empty list")
        brokers: list[BrokerInfo] = []
        seen: set[str] = set()
        for i, feat in enumerate(features):
            where = f"{source}.features[{i}]"
            if not isinstance(feat, dict):
                raise InvalidInput(where, "must be a Feature object")
            props = feat.get("properties")
            if not isinstance(props, dict):
                raise InvalidInput(f"{where}.properties", "must be an object")
            bid = validate_id(props.get("id"), f"{where}.properties.id")
            if bid in seen:
                raise InvalidInput(f"{where}.properties.id", f"duplicate broker id {bid!r}")
            seen.add(bid)
            area = parse_geojson(feat.get("geometry"), f"{where}.geometry", max_vertices=1_000_000)
            site = props.get("site")
            site_ll = None
            if site is not None:
                if not isinstance(site, list) or len(site) != 2:
                    raise InvalidInput(f"{where}.properties.site", "must be [lon, lat]")
                site_ll = latlon(site[1], site[0], f"{where}.properties.site")
            brokers.append(
                BrokerInfo(
                    id=bid,
                    area=area,
                    endpoint=_endpoint(props.get("endpoint"), f"{where}.properties.endpoint"),
                    client_endpoint=_endpoint(
                        props.get("client_endpoint"), f"{where}.properties.client_endpoint"
                    ),
                    site=site_ll,
                    name=str(props.get("name") or ""),
                    mqtt_endpoint=_endpoint(
                        props.get("mqtt_endpoint"), f"{where}.properties.mqtt_endpoint"
                    ),
                    mqtt_ws_endpoint=_endpoint(
                        props.get("mqtt_ws_endpoint"), f"{where}.properties.mqtt_ws_endpoint"
                    ),
                    http_endpoint=_endpoint(
                        props.get("http_endpoint"), f"{where}.properties.http_endpoint"
                    ),
                )
            )
        return cls(brokers)

    @classmethod
    def load(cls, path: str | Path) -> Federation:
        """Read a federation file, or a bundled federation by name (`federation_path`).

        Raises:
            InvalidInput: naming the file (missing, unreadable, not JSON) or the bad field.
        """
        p = federation_path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidInput("federation", f"cannot read {p}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise InvalidInput("federation", f"{p} is not UTF-8: {exc.reason}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(
                "federation", f"{p} is not JSON: {exc.msg} (line {exc.lineno})"
            ) from None
        return cls.from_geojson(obj, source=f"federation {p.name}")


BUNDLED_PACKAGE = "geofed.federations"
"""The package whose ``<name>.geojson`` files are the bundled federations."""


def bundled_federations() -> list[str]:
    """Names of the federations that ship with geofed (``aws-2020``, ``three``, ...)."""
    root = resources.files(BUNDLED_PACKAGE)
    return sorted(
        f.name.removesuffix(".geojson") for f in root.iterdir() if f.name.endswith(".geojson")
    )


def federation_path(name_or_path: str | Path) -> Path:
    """The file of a federation: a path that exists, or the name of a bundled one.

    Raises:
        InvalidInput: (field ``federation``) when it is neither.
    """
    p = Path(name_or_path)
    if p.exists():
        return p
    name = str(name_or_path)
    if "/" not in name and not name.endswith(".geojson"):
        candidate = resources.files(BUNDLED_PACKAGE).joinpath(f"{name}.geojson")
        if candidate.is_file():
            return Path(str(candidate))
    raise InvalidInput(
        "federation",
        f"no such file or bundled federation: {name!r} "
        f"(bundled: {', '.join(bundled_federations())})",
    )


def _json_shaped(value: Any) -> Any:
    """Shapely's GeoJSON mapping with lists for tuples, as parsed JSON has."""
    if isinstance(value, dict):
        return {k: _json_shaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_shaped(v) for v in value]
    return value


def _endpoint(value: Any, field: str) -> str:
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise InvalidInput(field, "must be a 'host:port' string")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(field, f"must be 'host:port', got {value!r}")
    return value
