"""The OpenAPI 3 description of the HTTP bridge (``GET /openapi.json``).

Written out by hand next to the routes of `_http` (a test holds every route
the bridge registers against this document, and the reverse).
"""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/responses/Error"}


def _param(name: str, where: str, description: str, *, required: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "required": required or where == "path",
        "description": description,
        "schema": {"type": "string"},
    }


_TOPIC = _param("topic", "path", "topic name (no wildcards); '/' separates levels")
_FILTER = _param(
    "filter", "path", "MQTT topic filter: '+' one level, '#' (URL-encoded %23) the rest"
)
_LOCATION = _param("location", "query", "LAT,LON in decimal degrees")
_GEOFENCE = _param(
    "geofence", "query", "WKT or GeoJSON Polygon/MultiPolygon (lon lat), circle:LAT,LON,RADIUS_M"
)
_CLIENT = _param("client", "query", "client id (policy identity); default: one made for the call")
_EVENT_ID = _param("id", "query", "event id; a retry with the same id is published once")

_PUBLISH: dict[str, Any] = {
    "summary": "Publish the request body as one event",
    "description": (
        "Answered once the broker accepted the event (with a store: once it is durable)."
        " A publisher located in another broker's area is redirected (307) to that broker."
    ),
    "parameters": [_TOPIC, _GEOFENCE, _CLIENT, _EVENT_ID],
    "requestBody": {
        "description": "the event payload (at most max_payload_bytes)",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    "responses": {
        "200": {
            "description": "accepted",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Published"}}},
        },
        "307": {"$ref": "#/components/responses/Redirect"},
        "400": _ERROR,
        "401": _ERROR,
        "403": _ERROR,
        "413": _ERROR,
        "503": _ERROR,
    },
}


_HISTORY_PARAMS = [
    _param("topic", "path", "MQTT topic filter: '+' one level, '#' (URL-encoded %23) the rest"),
    _param("from", "query", "earliest publish time: seconds since the epoch or ISO 8601"),
    _param("to", "query", "latest publish time (included): seconds since the epoch or ISO 8601"),
    _param(
        "geometry",
        "query",
        "area the publishers were in: WKT or GeoJSON Polygon/MultiPolygon, circle:LAT,LON,RADIUS_M",
    ),
    {
        **_param(
            "size",
            "query",
            "most events answered, newest first (default and maximum: history_max_rows)",
        ),
        "schema": {"type": "integer", "minimum": 1},
    },
    _param("client", "query", "client id for the policy's %c (optional)"),
]
_HISTORY_RESPONSES = {
    "200": {
        "description": "GeoJSON FeatureCollection, newest first; 'truncated' when"
        " history_max_answer_bytes cut it, 'brokers' the brokers asked",
        "content": {"application/geo+json": {"schema": {"type": "object"}}},
    },
    "400": _ERROR,
    "401": _ERROR,
    "403": _ERROR,
    "413": _ERROR,
    "503": _ERROR,
}
_READ = {
    "summary": "The logged events that match, newest first (federation-wide)",
    "description": "Asks only the brokers whose areas meet the geometry.",
    "parameters": _HISTORY_PARAMS,
    "responses": _HISTORY_RESPONSES,
}
_DELETE = {
    "summary": "Remove the logged events that match and answer what was removed",
    "parameters": _HISTORY_PARAMS,
    "responses": _HISTORY_RESPONSES,
}


def _json(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": schema or {"type": "object"}}},
    }


_STRATEGY_CHANGED: dict[str, Any] = {
    "200": _json("strategy state"),
    "400": _ERROR,
    "401": _ERROR,
    "403": _ERROR,
    "503": _ERROR,
}


def openapi_document(broker_id: str) -> dict[str, Any]:
    """The bridge's API (the same on every broker; `broker_id` names this one)."""
    publish_location = {
        **_LOCATION,
        "description": "LAT,LON of the publisher (default: a point of this broker's area)",
    }
    geopublish = {
        **_PUBLISH,
        "summary": "Publish the request body as one event at a location",
        "parameters": [_TOPIC, {**_LOCATION, "required": True}, _GEOFENCE, _CLIENT, _EVENT_ID],
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "geofed HTTP bridge",
            "version": "1",
            "description": (
                "Publish, subscribe (Server-Sent Events) and the web map of one geofed broker"
                f" ({broker_id}). Errors are JSON naming the parameter (field)."
            ),
        },
        "paths": {
            "/publish/{topic}": {
                "put": {
                    **_PUBLISH,
                    "parameters": [_TOPIC, publish_location, *_PUBLISH["parameters"][1:]],
                },
                "get": _READ,
                "delete": _DELETE,
            },
            "/geopublish/{topic}": {"put": geopublish, "get": _READ, "delete": _DELETE},
            "/subscribe/{filter}": {
                "get": {
                    "summary": "Matching events as they arrive (Server-Sent Events)",
                    "description": (
                        "A plain subscription at this broker while the stream is open: first an"
                        " event 'ready', then one 'event' per delivery, data a GeoJSON Feature."
                        " The geofence is the subscription geofence (where publishers must be);"
                        " the location is the subscriber's (event geofences are checked"
                        " against it). A location in another broker's area is redirected (307)."
                    ),
                    "parameters": [_FILTER, _LOCATION, _GEOFENCE, _CLIENT],
                    "responses": {
                        "200": {
                            "description": "event stream",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        "307": {"$ref": "#/components/responses/Redirect"},
                        "400": _ERROR,
                        "401": _ERROR,
                        "403": _ERROR,
                    },
                }
            },
            "/ws/subscribe/{filter}": {
                "get": {
                    "summary": "Matching events as they arrive, over a WebSocket",
                    "description": (
                        "The stream of /subscribe/{filter} over a WebSocket: text messages, first"
                        " {'type': 'ready', ...}, then one GeoJSON Feature per delivery. The"
                        " client's close ends the subscription."
                    ),
                    "parameters": [_FILTER, _LOCATION, _GEOFENCE, _CLIENT],
                    "responses": {
                        "101": {"description": "switching to the WebSocket protocol"},
                        "307": {"$ref": "#/components/responses/Redirect"},
                        "400": _ERROR,
                        "401": _ERROR,
                        "403": _ERROR,
                    },
                }
            },
            "/api/federation": {
                "get": {
                    "summary": "The federation file, this broker, its strategy and map settings",
                    "responses": {"200": _json("federation")},
                }
            },
            "/api/status": {
                "get": {
                    "summary": "This broker's peer links: up or down, messages and rates",
                    "responses": {"200": _json("link status")},
                }
            },
            "/api/federation/status": {
                "get": {
                    "summary": "Every broker's /api/status, read from its bridge",
                    "responses": {"200": _json("status by broker id")},
                }
            },
            "/api/route": {
                "get": {
                    "summary": "Which brokers a geofence reaches, per strategy (the routing core)",
                    "parameters": [
                        {**_GEOFENCE, "required": True},
                        _param("origin", "query", "broker the geofence is used at (default: this)"),
                    ],
                    "responses": {"200": _json("route summary"), "400": _ERROR, "413": _ERROR},
                }
            },
            "/api/strategy": {
                "get": {
                    "summary": "This broker's strategy table, the newest it knows, and whether a"
                    " transition is under way (as `geofed strategy show`)",
                    "responses": {"200": _json("strategy state"), "401": _ERROR},
                }
            },
            "/api/strategy/{filter}": {
                "put": {
                    "summary": "Route the filter's topics by a strategy, federation-wide",
                    "description": (
                        "Answered once the federation's sequencer has numbered the change;"
                        " the transition then runs on every broker (`in_transition`)."
                        " Needs `strategy_admins` membership when clients authenticate."
                        " 503 while a link is down or when the change was lost on its way:"
                        " asking again is safe."
                    ),
                    "parameters": [
                        _FILTER,
                        {
                            **_param(
                                "strategy",
                                "query",
                                "flooding-events, flooding-subscriptions,"
                                " event-geofence or subscription-geofence",
                            ),
                            "required": True,
                        },
                    ],
                    "responses": _STRATEGY_CHANGED,
                },
                "delete": {
                    "summary": "Remove the filter's entry (its topics follow the table's others)",
                    "parameters": [_FILTER],
                    "responses": _STRATEGY_CHANGED,
                },
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": _json("OpenAPI 3")}}
            },
            "/": {
                "get": {
                    "summary": "The web map",
                    "responses": {"200": {"description": "HTML", "content": {"text/html": {}}}},
                }
            },
            "/static/{filename}": {
                "get": {
                    "summary": "The web map's files (scripts, styles, the world outline)",
                    "parameters": [_param("filename", "path", "file path")],
                    "responses": {"200": {"description": "file"}, "404": _ERROR},
                }
            },
        },
        # Which applies depends on the node's client_auth (none: no identity needed).
        "security": [{}, {"bearer": []}, {"accessToken": []}],
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"},
                "accessToken": {
                    "type": "apiKey",
                    "in": "query",
                    "name": "access_token",
                    "description": "the bearer token in the URL, for EventSource and WebSocket",
                },
            },
            "schemas": {
                "Published": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "topic": {"type": "string"},
                        "broker": {"type": "string"},
                        "time": {"type": "number"},
                        "location": {"type": "array", "items": {"type": "number"}},
                        "geofence": {"type": "string", "nullable": True},
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["type", "message"],
                    "properties": {
                        "type": {"type": "string"},
                        "message": {"type": "string"},
                        "field": {"type": "string", "description": "the parameter at fault"},
                    },
                },
            },
            "responses": {
                "Error": {
                    "description": "refused; the body names the parameter",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    },
                },
                "Redirect": {
                    "description": "the location belongs to another broker: the same request"
                    " there (Location header)",
                    "headers": {"Location": {"schema": {"type": "string"}}},
                },
            },
        },
    }
