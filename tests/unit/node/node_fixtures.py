"""A broker node built but not started, on loopback ports, for tests of its parts."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from geofed.node import BrokerServer, NodeConfig


def unstarted_node(broker_id: str = "eu", **settings: Any) -> BrokerServer:
    """`broker_id` of the bundled three-broker federation, with `settings` on top."""
    config = NodeConfig(
        broker_id=broker_id,
        federation="three",
        client_listen="127.0.0.1:0",
        peer_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        **settings,
    )
    return BrokerServer(config, CollectorRegistry())
