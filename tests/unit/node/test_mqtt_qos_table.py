"""The MQTT listener's table of granted QoS stays within a constant factor of the live
subscriptions, however many subscriptions come and go."""

from __future__ import annotations

from node_fixtures import unstarted_node

from geofed.node._mqtt import _QOS_SWEEP_AT, MqttListener
from geofed.routing import LatLon, Subscription

PARIS = LatLon(48.85, 2.35)


def listener() -> MqttListener:
    return MqttListener(unstarted_node(mqtt_listen="127.0.0.1:0"))


def test_entries_of_ended_subscriptions_are_swept_and_live_ones_kept() -> None:
    mqtt = listener()
    core = mqtt.node.core
    core.connect("live", PARIS)
    for i in range(3):
        core.subscribe(Subscription(f"s{i}", "live", "a/#"))
        mqtt.grant(("live", f"s{i}"), i % 2)
    # Clients that came and went: their subscriptions are no longer held.
    for i in range(_QOS_SWEEP_AT - 3):
        mqtt.grant((f"gone-{i}", "s"), 1)
    assert len(mqtt.qos) == _QOS_SWEEP_AT  # not past the threshold yet: nothing swept
    mqtt.grant(("gone-last", "s"), 0)
    assert mqtt.qos == {("live", "s0"): 0, ("live", "s1"): 1, ("live", "s2"): 0}
    for i in range(10 * _QOS_SWEEP_AT):
        mqtt.grant((f"later-{i}", "s"), 1)
        assert len(mqtt.qos) <= _QOS_SWEEP_AT + 1
    assert ("live", "s1") in mqtt.qos
