from geofed.v1 import geo_pb2 as _geo_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerHistoryRequest(_message.Message):
    __slots__ = ("broker_id", "topic_filter", "start", "end", "geometry_wkb", "limit", "max_bytes", "delete_ids")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_WKB_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELETE_IDS_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    topic_filter: str
    start: float
    end: float
    geometry_wkb: bytes
    limit: int
    max_bytes: int
    delete_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, broker_id: _Optional[str] = ..., topic_filter: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., geometry_wkb: _Optional[bytes] = ..., limit: _Optional[int] = ..., max_bytes: _Optional[int] = ..., delete_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PeerHistoryResponse(_message.Message):
    __slots__ = ("events", "truncated")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_geo_pb2.Event]
    truncated: bool
    def __init__(self, events: _Optional[_Iterable[_Union[_geo_pb2.Event, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("broker_id", "strategy", "federation_digest", "protocol_version", "epoch", "finished_table", "adaptive")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FEDERATION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TABLE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    strategy: str
    federation_digest: str
    protocol_version: int
    epoch: int
    finished_table: _geo_pb2.StrategyTable
    adaptive: str
    def __init__(self, broker_id: _Optional[str] = ..., strategy: _Optional[str] = ..., federation_digest: _Optional[str] = ..., protocol_version: _Optional[int] = ..., epoch: _Optional[int] = ..., finished_table: _Optional[_Union[_geo_pb2.StrategyTable, _Mapping]] = ..., adaptive: _Optional[str] = ...) -> None: ...

class TableState(_message.Message):
    __slots__ = ("table", "phase")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    table: _geo_pb2.StrategyTable
    phase: int
    def __init__(self, table: _Optional[_Union[_geo_pb2.StrategyTable, _Mapping]] = ..., phase: _Optional[int] = ...) -> None: ...

class StrategyProposal(_message.Message):
    __slots__ = ("topic_filter", "strategy")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    strategy: str
    def __init__(self, topic_filter: _Optional[str] = ..., strategy: _Optional[str] = ...) -> None: ...

class RemoteSubscription(_message.Message):
    __slots__ = ("subscription", "home", "at")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    HOME_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    subscription: _geo_pb2.Subscription
    home: str
    at: _geo_pb2.LatLon
    def __init__(self, subscription: _Optional[_Union[_geo_pb2.Subscription, _Mapping]] = ..., home: _Optional[str] = ..., at: _Optional[_Union[_geo_pb2.LatLon, _Mapping]] = ...) -> None: ...

class Relocation(_message.Message):
    __slots__ = ("client", "subscription_id", "home", "at")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    HOME_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    client: str
    subscription_id: str
    home: str
    at: _geo_pb2.LatLon
    def __init__(self, client: _Optional[str] = ..., subscription_id: _Optional[str] = ..., home: _Optional[str] = ..., at: _Optional[_Union[_geo_pb2.LatLon, _Mapping]] = ...) -> None: ...

class Unsubscription(_message.Message):
    __slots__ = ("subscription_id", "home", "client")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    HOME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    home: str
    client: str
    def __init__(self, subscription_id: _Optional[str] = ..., home: _Optional[str] = ..., client: _Optional[str] = ...) -> None: ...

class SubscriptionRef(_message.Message):
    __slots__ = ("client", "id")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    client: str
    id: str
    def __init__(self, client: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class EventDelivery(_message.Message):
    __slots__ = ("event", "subscriptions")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    event: _geo_pb2.Event
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionRef]
    def __init__(self, event: _Optional[_Union[_geo_pb2.Event, _Mapping]] = ..., subscriptions: _Optional[_Iterable[_Union[SubscriptionRef, _Mapping]]] = ...) -> None: ...

class SubscriptionSnapshot(_message.Message):
    __slots__ = ("subscriptions", "continued")
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[RemoteSubscription]
    continued: bool
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[RemoteSubscription, _Mapping]]] = ..., continued: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("seq", "hello", "ack", "events", "subscribes", "unsubscribes", "deliveries", "snapshot", "refuse_reason", "relocations", "tables", "proposals", "reports", "flushes", "handoffs", "sessions")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBES_FIELD_NUMBER: _ClassVar[int]
    UNSUBSCRIBES_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    REFUSE_REASON_FIELD_NUMBER: _ClassVar[int]
    RELOCATIONS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    FLUSHES_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    hello: Hello
    ack: Ack
    events: _containers.RepeatedCompositeFieldContainer[_geo_pb2.Event]
    subscribes: _containers.RepeatedCompositeFieldContainer[RemoteSubscription]
    unsubscribes: _containers.RepeatedCompositeFieldContainer[Unsubscription]
    deliveries: _containers.RepeatedCompositeFieldContainer[EventDelivery]
    snapshot: SubscriptionSnapshot
    refuse_reason: str
    relocations: _containers.RepeatedCompositeFieldContainer[Relocation]
    tables: _containers.RepeatedCompositeFieldContainer[TableState]
    proposals: _containers.RepeatedCompositeFieldContainer[StrategyProposal]
    reports: _containers.RepeatedCompositeFieldContainer[AdaptiveReport]
    flushes: _containers.RepeatedCompositeFieldContainer[Flush]
    handoffs: _containers.RepeatedCompositeFieldContainer[QueueHandoff]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionTransfer]
    def __init__(self, seq: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., events: _Optional[_Iterable[_Union[_geo_pb2.Event, _Mapping]]] = ..., subscribes: _Optional[_Iterable[_Union[RemoteSubscription, _Mapping]]] = ..., unsubscribes: _Optional[_Iterable[_Union[Unsubscription, _Mapping]]] = ..., deliveries: _Optional[_Iterable[_Union[EventDelivery, _Mapping]]] = ..., snapshot: _Optional[_Union[SubscriptionSnapshot, _Mapping]] = ..., refuse_reason: _Optional[str] = ..., relocations: _Optional[_Iterable[_Union[Relocation, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TableState, _Mapping]]] = ..., proposals: _Optional[_Iterable[_Union[StrategyProposal, _Mapping]]] = ..., reports: _Optional[_Iterable[_Union[AdaptiveReport, _Mapping]]] = ..., flushes: _Optional[_Iterable[_Union[Flush, _Mapping]]] = ..., handoffs: _Optional[_Iterable[_Union[QueueHandoff, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionTransfer, _Mapping]]] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ("token", "reply")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    token: int
    reply: bool
    def __init__(self, token: _Optional[int] = ..., reply: _Optional[bool] = ...) -> None: ...

class SessionTransfer(_message.Message):
    __slots__ = ("token", "client", "owner", "at", "expiry_s", "subscriptions", "mqtt_qos", "queued")
    class MqttQosEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    MQTT_QOS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    token: int
    client: str
    owner: str
    at: _geo_pb2.LatLon
    expiry_s: float
    subscriptions: _containers.RepeatedCompositeFieldContainer[RemoteSubscription]
    mqtt_qos: _containers.ScalarMap[str, int]
    queued: _containers.RepeatedCompositeFieldContainer[QueuedEvents]
    def __init__(self, token: _Optional[int] = ..., client: _Optional[str] = ..., owner: _Optional[str] = ..., at: _Optional[_Union[_geo_pb2.LatLon, _Mapping]] = ..., expiry_s: _Optional[float] = ..., subscriptions: _Optional[_Iterable[_Union[RemoteSubscription, _Mapping]]] = ..., mqtt_qos: _Optional[_Mapping[str, int]] = ..., queued: _Optional[_Iterable[_Union[QueuedEvents, _Mapping]]] = ...) -> None: ...

class QueuedEvents(_message.Message):
    __slots__ = ("subscription_id", "event_ids")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    event_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, subscription_id: _Optional[str] = ..., event_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class QueueHandoff(_message.Message):
    __slots__ = ("id", "subscription", "deliveries")
    ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    id: str
    subscription: SubscriptionRef
    deliveries: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, id: _Optional[str] = ..., subscription: _Optional[_Union[SubscriptionRef, _Mapping]] = ..., deliveries: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AdaptiveReport(_message.Message):
    __slots__ = ("window", "keys")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    window: int
    keys: _containers.RepeatedCompositeFieldContainer[KeyShare]
    def __init__(self, window: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[KeyShare, _Mapping]]] = ...) -> None: ...

class KeyShare(_message.Message):
    __slots__ = ("key", "strategy", "events", "subscribes", "unsubscribes", "event_reach", "subscription_reach", "predicted", "moved")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBES_FIELD_NUMBER: _ClassVar[int]
    UNSUBSCRIBES_FIELD_NUMBER: _ClassVar[int]
    EVENT_REACH_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_REACH_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    key: str
    strategy: str
    events: int
    subscribes: int
    unsubscribes: int
    event_reach: int
    subscription_reach: int
    predicted: _containers.RepeatedCompositeFieldContainer[StrategyCount]
    moved: _containers.RepeatedCompositeFieldContainer[StrategyCount]
    def __init__(self, key: _Optional[str] = ..., strategy: _Optional[str] = ..., events: _Optional[int] = ..., subscribes: _Optional[int] = ..., unsubscribes: _Optional[int] = ..., event_reach: _Optional[int] = ..., subscription_reach: _Optional[int] = ..., predicted: _Optional[_Iterable[_Union[StrategyCount, _Mapping]]] = ..., moved: _Optional[_Iterable[_Union[StrategyCount, _Mapping]]] = ...) -> None: ...

class StrategyCount(_message.Message):
    __slots__ = ("strategy", "messages")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    messages: int
    def __init__(self, strategy: _Optional[str] = ..., messages: _Optional[int] = ...) -> None: ...
