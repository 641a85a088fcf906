from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LatLon(_message.Message):
    __slots__ = ("lat", "lon")
    LAT_FIELD_NUMBER: _ClassVar[int]
    LON_FIELD_NUMBER: _ClassVar[int]
    lat: float
    lon: float
    def __init__(self, lat: _Optional[float] = ..., lon: _Optional[float] = ...) -> None: ...

class Circle(_message.Message):
    __slots__ = ("center", "radius_m")
    CENTER_FIELD_NUMBER: _ClassVar[int]
    RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    center: LatLon
    radius_m: float
    def __init__(self, center: _Optional[_Union[LatLon, _Mapping]] = ..., radius_m: _Optional[float] = ...) -> None: ...

class Offset(_message.Message):
    __slots__ = ("east_m", "north_m")
    EAST_M_FIELD_NUMBER: _ClassVar[int]
    NORTH_M_FIELD_NUMBER: _ClassVar[int]
    east_m: float
    north_m: float
    def __init__(self, east_m: _Optional[float] = ..., north_m: _Optional[float] = ...) -> None: ...

class RoamingPolygon(_message.Message):
    __slots__ = ("vertices",)
    VERTICES_FIELD_NUMBER: _ClassVar[int]
    vertices: _containers.RepeatedCompositeFieldContainer[Offset]
    def __init__(self, vertices: _Optional[_Iterable[_Union[Offset, _Mapping]]] = ...) -> None: ...

class Roaming(_message.Message):
    __slots__ = ("radius_m", "polygon")
    RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    POLYGON_FIELD_NUMBER: _ClassVar[int]
    radius_m: float
    polygon: RoamingPolygon
    def __init__(self, radius_m: _Optional[float] = ..., polygon: _Optional[_Union[RoamingPolygon, _Mapping]] = ...) -> None: ...

class Geofence(_message.Message):
    __slots__ = ("wkt", "geojson", "circle", "roaming")
    WKT_FIELD_NUMBER: _ClassVar[int]
    GEOJSON_FIELD_NUMBER: _ClassVar[int]
    CIRCLE_FIELD_NUMBER: _ClassVar[int]
    ROAMING_FIELD_NUMBER: _ClassVar[int]
    wkt: str
    geojson: str
    circle: Circle
    roaming: Roaming
    def __init__(self, wkt: _Optional[str] = ..., geojson: _Optional[str] = ..., circle: _Optional[_Union[Circle, _Mapping]] = ..., roaming: _Optional[_Union[Roaming, _Mapping]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "topic", "payload", "publisher", "geofence", "publish_time", "origin")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    GEOFENCE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    id: str
    topic: str
    payload: bytes
    publisher: LatLon
    geofence: Geofence
    publish_time: float
    origin: str
    def __init__(self, id: _Optional[str] = ..., topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., publisher: _Optional[_Union[LatLon, _Mapping]] = ..., geofence: _Optional[_Union[Geofence, _Mapping]] = ..., publish_time: _Optional[float] = ..., origin: _Optional[str] = ...) -> None: ...

class Subscription(_message.Message):
    __slots__ = ("id", "client", "topic_filter", "geofence")
    ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    GEOFENCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    client: str
    topic_filter: str
    geofence: Geofence
    def __init__(self, id: _Optional[str] = ..., client: _Optional[str] = ..., topic_filter: _Optional[str] = ..., geofence: _Optional[_Union[Geofence, _Mapping]] = ...) -> None: ...

class StrategyEntry(_message.Message):
    __slots__ = ("topic_filter", "strategy", "adaptive")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    strategy: str
    adaptive: bool
    def __init__(self, topic_filter: _Optional[str] = ..., strategy: _Optional[str] = ..., adaptive: _Optional[bool] = ...) -> None: ...

class StrategyTable(_message.Message):
    __slots__ = ("epoch", "default_strategy", "entries")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    default_strategy: str
    entries: _containers.RepeatedCompositeFieldContainer[StrategyEntry]
    def __init__(self, epoch: _Optional[int] = ..., default_strategy: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[StrategyEntry, _Mapping]]] = ...) -> None: ...
