from geofed.v1 import geo_pb2 as _geo_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConnectRequest(_message.Message):
    __slots__ = ("client", "location", "session_expiry_s")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    client: str
    location: _geo_pb2.LatLon
    session_expiry_s: float
    def __init__(self, client: _Optional[str] = ..., location: _Optional[_Union[_geo_pb2.LatLon, _Mapping]] = ..., session_expiry_s: _Optional[float] = ...) -> None: ...

class Redirect(_message.Message):
    __slots__ = ("broker_id", "endpoint")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    endpoint: str
    def __init__(self, broker_id: _Optional[str] = ..., endpoint: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("broker_id", "accepted", "redirect", "session_present", "session_expiry_s", "held_s")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    SESSION_PRESENT_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    accepted: bool
    redirect: Redirect
    session_present: bool
    session_expiry_s: float
    held_s: float
    def __init__(self, broker_id: _Optional[str] = ..., accepted: _Optional[bool] = ..., redirect: _Optional[_Union[Redirect, _Mapping]] = ..., session_present: _Optional[bool] = ..., session_expiry_s: _Optional[float] = ..., held_s: _Optional[float] = ...) -> None: ...

class UpdateLocationRequest(_message.Message):
    __slots__ = ("client", "location", "hold")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    client: str
    location: _geo_pb2.LatLon
    hold: bool
    def __init__(self, client: _Optional[str] = ..., location: _Optional[_Union[_geo_pb2.LatLon, _Mapping]] = ..., hold: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("client",)
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    client: str
    def __init__(self, client: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("client", "subscription", "resume_after", "handover")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    client: str
    subscription: _geo_pb2.Subscription
    resume_after: int
    handover: bool
    def __init__(self, client: _Optional[str] = ..., subscription: _Optional[_Union[_geo_pb2.Subscription, _Mapping]] = ..., resume_after: _Optional[int] = ..., handover: _Optional[bool] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("subscription_id", "event", "deliver_time", "offset", "batch", "filter_scheme")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    DELIVER_TIME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FILTER_SCHEME_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    event: _geo_pb2.Event
    deliver_time: float
    offset: int
    batch: _containers.RepeatedCompositeFieldContainer[Delivery]
    filter_scheme: str
    def __init__(self, subscription_id: _Optional[str] = ..., event: _Optional[_Union[_geo_pb2.Event, _Mapping]] = ..., deliver_time: _Optional[float] = ..., offset: _Optional[int] = ..., batch: _Optional[_Iterable[_Union[Delivery, _Mapping]]] = ..., filter_scheme: _Optional[str] = ...) -> None: ...

class UnsubscribeRequest(_message.Message):
    __slots__ = ("client", "subscription_id")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    client: str
    subscription_id: str
    def __init__(self, client: _Optional[str] = ..., subscription_id: _Optional[str] = ...) -> None: ...

class UnsubscribeResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("client", "event")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    client: str
    event: _geo_pb2.Event
    def __init__(self, client: _Optional[str] = ..., event: _Optional[_Union[_geo_pb2.Event, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    def __init__(self, event_id: _Optional[str] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("event_id", "refused")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    refused: Refusal
    def __init__(self, event_id: _Optional[str] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("code", "details", "error")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    error: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class PublishBatch(_message.Message):
    __slots__ = ("client", "events")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    client: str
    events: _containers.RepeatedCompositeFieldContainer[_geo_pb2.Event]
    def __init__(self, client: _Optional[str] = ..., events: _Optional[_Iterable[_Union[_geo_pb2.Event, _Mapping]]] = ...) -> None: ...

class PublishBatchResponse(_message.Message):
    __slots__ = ("accepted", "event_ids")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    event_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, accepted: _Optional[int] = ..., event_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("client", "subscription_id", "offset")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    client: str
    subscription_id: str
    offset: int
    def __init__(self, client: _Optional[str] = ..., subscription_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("client", "topic_filter", "start", "end", "geometry", "limit", "delete")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    client: str
    topic_filter: str
    start: float
    end: float
    geometry: _geo_pb2.Geofence
    limit: int
    delete: bool
    def __init__(self, client: _Optional[str] = ..., topic_filter: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., geometry: _Optional[_Union[_geo_pb2.Geofence, _Mapping]] = ..., limit: _Optional[int] = ..., delete: _Optional[bool] = ...) -> None: ...

class HistoryResponse(_message.Message):
    __slots__ = ("events", "truncated", "brokers")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    BROKERS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_geo_pb2.Event]
    truncated: bool
    brokers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, events: _Optional[_Iterable[_Union[_geo_pb2.Event, _Mapping]]] = ..., truncated: _Optional[bool] = ..., brokers: _Optional[_Iterable[str]] = ...) -> None: ...

class SetStrategyRequest(_message.Message):
    __slots__ = ("topic_filter", "strategy")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    strategy: str
    def __init__(self, topic_filter: _Optional[str] = ..., strategy: _Optional[str] = ...) -> None: ...

class GetStrategyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StrategyState(_message.Message):
    __slots__ = ("broker_id", "table", "newest", "in_transition", "sequencer")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    IN_TRANSITION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCER_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    table: _geo_pb2.StrategyTable
    newest: _geo_pb2.StrategyTable
    in_transition: bool
    sequencer: str
    def __init__(self, broker_id: _Optional[str] = ..., table: _Optional[_Union[_geo_pb2.StrategyTable, _Mapping]] = ..., newest: _Optional[_Union[_geo_pb2.StrategyTable, _Mapping]] = ..., in_transition: _Optional[bool] = ..., sequencer: _Optional[str] = ...) -> None: ...
