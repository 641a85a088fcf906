"""geofed routing core: pure, synchronous geo-context routing logic.

Geometry, broker areas, topic filters, the match predicate, the subscription
index, the four routing strategies with their cost model, the broker state
machine and an in-memory federation simulator. No network, no clocks.
"""

from ._areagen import Site, generate_areas, read_sites
from ._broker import (
    BrokerState,
    Delivery,
    DeliveryMsg,
    EventMsg,
    Kind,
    Moved,
    Outcome,
    PeerMessage,
    Send,
    SubscribeMsg,
    UnsubscribeMsg,
)
from ._cost import CostReport, predict
from ._errors import FederationMismatch, GeofedError, InvalidInput, NotFound, TooLarge, WrongBroker
from ._federation import BrokerInfo, Federation, bundled_federations, federation_path
from ._geometry import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_VERTICES,
    EARTH_RADIUS_M,
    MIN_CIRCLE_RADIUS_M,
    Geofence,
    GeofenceCache,
    LatLon,
    build_geofence,
    check_text_size,
    circle,
    covers,
    great_circle_m,
    latlon,
    parse_geofence,
    parse_geojson,
    parse_wkt,
    to_wkt,
)
from ._index import SubscriptionIndex
from ._model import (
    Event,
    Subscription,
    content_and_subscription_geocheck,
    make_event,
    make_subscription,
    matches,
    validate_id,
)
from ._oracle import reference_deliveries, reference_topic_match
from ._simulate import SimResult, Simulator, simulate
from ._strategies import STRATEGIES, Strategy, strategy_for
from ._topics import topic_matches, validate_filter, validate_topic
from ._trace import TraceOp, op_to_record, parse_op, parse_ops, read_trace

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_VERTICES",
    "EARTH_RADIUS_M",
    "MIN_CIRCLE_RADIUS_M",
    "STRATEGIES",
    "BrokerInfo",
    "BrokerState",
    "CostReport",
    "Delivery",
    "DeliveryMsg",
    "Event",
    "EventMsg",
    "Federation",
    "FederationMismatch",
    "GeofedError",
    "Geofence",
    "GeofenceCache",
    "InvalidInput",
    "Kind",
    "LatLon",
    "Moved",
    "NotFound",
    "Outcome",
    "PeerMessage",
    "Send",
    "SimResult",
    "Simulator",
    "Site",
    "Strategy",
    "SubscribeMsg",
    "Subscription",
    "SubscriptionIndex",
    "TooLarge",
    "TraceOp",
    "UnsubscribeMsg",
    "WrongBroker",
    "build_geofence",
    "bundled_federations",
    "check_text_size",
    "circle",
    "content_and_subscription_geocheck",
    "covers",
    "federation_path",
    "generate_areas",
    "great_circle_m",
    "latlon",
    "make_event",
    "make_subscription",
    "matches",
    "op_to_record",
    "parse_geofence",
    "parse_geojson",
    "parse_op",
    "parse_ops",
    "parse_wkt",
    "predict",
    "read_sites",
    "read_trace",
    "reference_deliveries",
    "reference_topic_match",
    "simulate",
    "strategy_for",
    "to_wkt",
    "topic_matches",
    "validate_filter",
    "validate_id",
    "validate_topic",
]
