"""BrokerState: the per-broker state machine, driven by hand."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from geofed.routing import (
    BrokerInfo,
    BrokerState,
    DeliveryMsg,
    Event,
    EventMsg,
    Federation,
    Kind,
    NotFound,
    PeerMessage,
    RelocateMsg,
    Roaming,
    Send,
    SubscribeMsg,
    Subscription,
    UnsubscribeMsg,
    WrongBroker,
    latlon,
    new_event_id,
    parse_wkt,
    strategy_for,
)

# Three bands of longitude: west [-180, -60], mid [-60, 60], east [60, 180].
FED = Federation(
    [
        BrokerInfo(
            "west",
            parse_wkt("POLYGON((-180 -90, -60 -90, -60 90, -180 90, -180 -90))"),
            "w:1",
            "w:2",
        ),
        BrokerInfo(
            "mid", parse_wkt("POLYGON((-60 -90, 60 -90, 60 90, -60 90, -60 -90))"), "m:1", "m:2"
        ),
        BrokerInfo(
            "east", parse_wkt("POLYGON((60 -90, 180 -90, 180 90, 60 90, 60 -90))"), "e:1", "e:2"
        ),
    ]
)
IN_WEST, IN_MID, IN_EAST = latlon(40, -100), latlon(48, 2), latlon(35, 139)
MID_ONLY = parse_wkt("POLYGON((-10 40, 10 40, 10 50, -10 50, -10 40))")
MID_AND_EAST = parse_wkt("POLYGON((50 40, 70 40, 70 50, 50 50, 50 40))")


def core(broker: str, strategy: str = "subscription-geofence") -> BrokerState:
    return BrokerState(broker, FED, strategy_for(strategy, FED))


def test_unknown_broker_id() -> None:
    with pytest.raises(NotFound):
        core("north")


def test_connect_outside_the_area_redirects() -> None:
    mid = core("mid")
    assert mid.connect("c1", IN_WEST) == "west"
    assert "c1" not in mid.sessions
    assert mid.connect("c1", IN_MID) is None
    assert mid.sessions["c1"] == IN_MID


def test_actions_need_a_session() -> None:
    mid = core("mid")
    with pytest.raises(NotFound):
        mid.subscribe(Subscription("s1", "ghost", "a"))
    with pytest.raises(NotFound):
        mid.update_location("ghost", IN_MID)
    with pytest.raises(NotFound):
        mid.unsubscribe("ghost", "s1")


def test_update_location_inside_the_area_stays() -> None:
    mid = core("mid")
    mid.connect("c1", IN_MID)
    moved = mid.update_location("c1", latlon(50, 10))
    assert moved.redirect is None and moved.sends == [] and moved.dropped == []
    assert mid.sessions["c1"] == latlon(50, 10)


def test_update_location_leaving_the_area() -> None:
    mid = core("mid", "subscription-geofence")
    mid.connect("c1", IN_MID)
    s_local = Subscription("s1", "c1", "a/#", MID_ONLY)  # goes nowhere
    s_far = Subscription("s2", "c1", "b", MID_AND_EAST)  # went to east
    s_world = Subscription("s3", "c1", "c", None)  # went to east and west
    for s in (s_local, s_far, s_world):
        mid.subscribe(s)
    moved = mid.update_location("c1", IN_EAST)
    assert moved.redirect == "east"
    assert sorted(moved.dropped, key=lambda s: s.id) == [s_local, s_far, s_world]
    assert sorted((s.dst, s.msg.key) for s in moved.sends) == [  # type: ignore[union-attr]
        ("east", ("c1", "s2")),
        ("east", ("c1", "s3")),
        ("west", ("c1", "s3")),
    ]
    assert all(isinstance(s.msg, UnsubscribeMsg) and s.msg.home == "mid" for s in moved.sends)
    assert "c1" not in mid.sessions and len(mid.local) == 0


def test_disconnect_withdraws_the_subscriptions() -> None:
    mid = core("mid", "flooding-subscriptions")
    mid.connect("c1", IN_MID)
    mid.subscribe(Subscription("s1", "c1", "a", MID_ONLY))
    sends = mid.disconnect("c1")
    assert sorted(s.dst for s in sends) == ["east", "west"]
    assert mid.disconnect("c1") == []  # idempotent


def test_publish_from_a_location_another_broker_owns() -> None:
    mid = core("mid")
    with pytest.raises(WrongBroker) as info:
        mid.publish(Event("e1", "a", IN_EAST))
    assert info.value.broker_id == "east"
    assert info.value.endpoint == "e:2"  # where the client must publish
    assert info.value.field == "event.publisher"


def test_subscription_id_owned_by_another_client() -> None:
    mid = core("mid")
    mid.connect("c1", IN_MID)


def test_subscription_ids_are_scoped_by_client() -> None:
    """Two clients may use the same subscription id: two subscriptions, here and at the
    peers, each withdrawn and delivered on its own."""
    mid = core("mid", "flooding-subscriptions")
    mid.connect("c1", IN_MID)
    mid.connect("c2", IN_MID)
    first = mid.subscribe(Subscription("s1", "c1", "a"))
    second = mid.subscribe(Subscription("s1", "c2", "b"))
    assert mid.local.get(("c1", "s1")).topic_filter == "a"  # type: ignore[union-attr]
    assert mid.local.get(("c2", "s1")).topic_filter == "b"  # type: ignore[union-attr]
    east = core("east", "flooding-subscriptions")
    for send in first + second:
        if send.dst == "east":
            east.on_message("mid", send.msg)
    assert len(east.remote) == 2
    east.connect("pub", IN_EAST)
    (delivery,) = [s.msg for s in east.publish(Event("e1", "b", IN_EAST)).sends]
    assert delivery.subs == (("c2", "s1"),)  # type: ignore[union-attr]
    assert [(d.client, d.subscription) for d in mid.on_message("east", delivery).deliveries] == [
        ("c2", "s1")
    ]
    for send in mid.unsubscribe("c1", "s1"):
        if send.dst == "east":
            east.on_message("mid", send.msg)
    assert [s.key for s in east.remote] == [("c2", "s1")]
    assert mid.local.get(("c1", "s1")) is None and ("c2", "s1") in mid.local


def test_changing_a_geofence_follows_the_new_path_and_withdraws_the_old() -> None:
    mid = core("mid", "subscription-geofence")
    mid.connect("c1", IN_MID)
    first = mid.subscribe(Subscription("s1", "c1", "a", None))
    assert [(s.dst, s.msg.kind) for s in first] == [
        ("east", Kind.SUBSCRIBE),
        ("west", Kind.SUBSCRIBE),
    ]
    second = mid.subscribe(Subscription("s1", "c1", "a", MID_AND_EAST))
    assert [(s.dst, s.msg.kind) for s in second] == [
        ("east", Kind.SUBSCRIBE),
        ("west", Kind.UNSUBSCRIBE),
    ]
    assert mid.unsubscribe("c1", "s1") == [Send("east", UnsubscribeMsg(("c1", "s1"), "mid"))]
    with pytest.raises(NotFound):
        mid.unsubscribe("c1", "s1")


def test_stale_unsubscribe_does_not_remove_a_newer_version() -> None:
    east = core("east", "flooding-subscriptions")
    sub = Subscription("s1", "c1", "a", None)
    east.on_message("mid", SubscribeMsg(sub, "mid"))
    # The subscriber moved to west and renewed there before mid's withdrawal arrived.
    east.on_message("west", SubscribeMsg(sub, "west"))
    east.on_message("mid", UnsubscribeMsg(sub.key, "mid"))
    assert east.remote_home(sub.key) == "west" and sub.key in east.remote
    east.on_message("west", UnsubscribeMsg(sub.key, "west"))
    assert east.remote_home(sub.key) is None and sub.key not in east.remote
    # An unknown withdrawal is harmless.
    east.on_message("west", UnsubscribeMsg(("c1", "nope"), "west"))


def test_matching_at_the_publisher_sends_one_delivery_per_subscriber_broker() -> None:
    east = core("east", "subscription-geofence")
    east.on_message("mid", SubscribeMsg(Subscription("s1", "c1", "a/+", None), "mid"))
    east.on_message("mid", SubscribeMsg(Subscription("s2", "c2", "a/#", None), "mid"))
    east.on_message("west", SubscribeMsg(Subscription("s3", "c3", "a/b", None), "west"))
    east.on_message("west", SubscribeMsg(Subscription("s4", "c4", "x", None), "west"))
    east.connect("pub", IN_EAST)
    out = east.publish(Event("e1", "a/b", IN_EAST))
    assert out.deliveries == []
    assert [(s.dst, s.msg.subs) for s in out.sends] == [  # type: ignore[union-attr]
        ("mid", (("c1", "s1"), ("c2", "s2"))),
        ("west", (("c3", "s3"),)),
    ]
    # An event geofence that only meets mid keeps west out.
    out = east.publish(Event("e2", "a/b", IN_EAST, MID_AND_EAST))
    assert [s.dst for s in out.sends] == ["mid"]


def test_subscriber_broker_applies_the_event_geocheck_with_the_live_location() -> None:
    mid = core("mid", "subscription-geofence")
    mid.connect("c1", IN_MID)
    mid.subscribe(Subscription("s1", "c1", "a", None))
    near = Event("e1", "a", IN_EAST, MID_ONLY)
    out = mid.on_message("east", DeliveryMsg(near, (("c1", "s1"), ("c1", "gone"))))
    assert [(d.event.id, d.subscription, d.client) for d in out.deliveries] == [("e1", "s1", "c1")]
    mid.update_location("c1", latlon(0, 0))  # still mid, outside MID_ONLY
    assert mid.on_message("east", DeliveryMsg(near, (("c1", "s1"),))).deliveries == []


def test_event_forwarding_matches_local_subscriptions() -> None:
    mid = core("mid", "event-geofence")
    mid.connect("c1", IN_MID)
    mid.subscribe(Subscription("s2", "c1", "a", None))
    mid.subscribe(
        Subscription(
            "s1", "c1", "a", parse_wkt("POLYGON((130 30, 140 30, 140 40, 130 40, 130 30))")
        )
    )
    out = mid.on_message("east", EventMsg(Event("e1", "a", IN_EAST)))
    assert [d.subscription for d in out.deliveries] == ["s1", "s2"]  # sorted by id
    east = core("east", "event-geofence")
    east.connect("pub", IN_EAST)
    assert [s.dst for s in east.publish(Event("e2", "a", IN_EAST, MID_ONLY)).sends] == ["mid"]
    assert [s.dst for s in east.publish(Event("e3", "a", IN_EAST, None)).sends] == ["mid", "west"]


def test_snapshot_for_and_replace_remote() -> None:
    mid = core("mid", "subscription-geofence")
    mid.connect("c1", IN_MID)
    mid.subscribe(Subscription("s1", "c1", "a", MID_ONLY))
    mid.subscribe(Subscription("s2", "c1", "a", MID_AND_EAST))
    mid.subscribe(Subscription("s3", "c1", "a", None))
    assert [m.sub.id for m in mid.snapshot_for("east")] == ["s2", "s3"]
    assert [m.sub.id for m in mid.snapshot_for("west")] == ["s3"]
    assert all(m.home == "mid" for m in mid.snapshot_for("east"))

    east = core("east", "subscription-geofence")
    east.on_message("mid", SubscribeMsg(Subscription("old", "c9", "a"), "mid"))
    east.on_message("west", SubscribeMsg(Subscription("w1", "c8", "a"), "west"))
    east.replace_remote("mid", mid.snapshot_for("east"))
    assert sorted(s.id for s in east.remote) == ["s2", "s3", "w1"]
    assert east.remote_home(("c1", "s2")) == "mid" and east.remote_home(("c8", "w1")) == "west"
    east.replace_remote("mid", [])
    assert sorted(s.id for s in east.remote) == ["w1"]


def test_flooding_events_keeps_subscriptions_local() -> None:
    mid = core("mid", "flooding-events")
    mid.connect("c1", IN_MID)
    assert mid.subscribe(Subscription("s1", "c1", "a", None)) == []
    assert mid.snapshot_for("east") == []
    out = mid.publish(Event("e1", "a", IN_MID, MID_ONLY))
    assert [d.subscription for d in out.deliveries] == ["s1"]
    assert [(s.dst, s.msg.kind) for s in out.sends] == [("east", Kind.EVENT), ("west", Kind.EVENT)]


@pytest.mark.parametrize(
    "strategy", ["subscription-geofence", "flooding-subscriptions", "event-geofence"]
)
def test_publish_many_gives_what_each_publish_gives(strategy: str) -> None:
    # One broker matches a batch at once; the answer is each event's own, in order.
    mid = core("mid", strategy)
    for i, (where, fence) in enumerate(
        [(IN_MID, None), (IN_MID, MID_ONLY), (latlon(45, 0), MID_AND_EAST), (IN_MID, MID_AND_EAST)]
    ):
        mid.connect(f"c{i}", where)
        mid.subscribe(Subscription(f"s{i}", f"c{i}", "a/+", fence))
    for home, where, fence in [("east", IN_EAST, MID_AND_EAST), ("west", IN_WEST, None)]:
        remote = Subscription("r", f"x-{home}", "a/#", fence)
        mid.on_message(home, SubscribeMsg(remote.placed(where), home))
    events = [
        Event(f"e{i}", topic, where, geofence)
        for i, (topic, where, geofence) in enumerate(
            [
                ("a/b", IN_MID, None),
                ("a/b", latlon(45, 0), MID_ONLY),
                ("a/b", IN_MID, None),  # the first's topic and point again
                ("b/c", IN_MID, None),
                ("a/c", latlon(45, 55), MID_AND_EAST),
                ("a/b", IN_MID, MID_AND_EAST),
            ]
        )
    ]
    batch = mid.publish_many(events)
    assert batch == [mid.publish(e) for e in events]
    assert any(o.deliveries for o in batch) and any(o.sends for o in batch)
    with pytest.raises(WrongBroker):  # nothing of a batch is matched when one is misplaced
        mid.publish_many([*events, Event("far", "a/b", IN_EAST)])


def test_new_event_ids_are_fresh_in_a_forked_child() -> None:
    # Ids are made in bulk: a child process must not hand out its parent's.
    new_event_id()  # the parent holds a bulk of ids now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id and leave at once
        os.write(write, new_event_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    os.close(read)
    ids = {new_event_id() for _ in range(300)}  # more than one bulk
    assert len(ids) == 300 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(child) == 32 and child not in ids


@st.composite
def _home_streams(draw: st.DrawFn) -> tuple[list[str], list[tuple[str, PeerMessage]], bool]:
    """A subscriber's path through the homes west and mid (east holds copies), and what
    reaches east: each home's messages in its own order, the homes interleaved at random
    (each link keeps its order, nothing more). Version i of the subscription (its i-th
    home) has topic filter ``a/i``; a move within a home relocates its roaming geofence."""
    path = draw(st.lists(st.sampled_from(["west", "mid"]), min_size=1, max_size=6))
    path = [h for i, h in enumerate(path) if i == 0 or h != path[i - 1]]  # a move changes home
    stays = draw(st.booleans())  # subscribed at the end, or withdrawn
    streams: dict[str, list[PeerMessage]] = {"west": [], "mid": []}
    for i, home in enumerate(path):
        sub = Subscription("s1", "c1", f"a/{i}", roaming=ROAM).placed(latlon(i, 0))
        streams[home].append(SubscribeMsg(sub, home))
        if draw(st.booleans()):
            streams[home].append(RelocateMsg(sub.key, home, latlon(i, 1)))
        if i < len(path) - 1 or not stays:
            streams[home].append(UnsubscribeMsg(sub.key, home))
    arrivals: list[tuple[str, PeerMessage]] = []
    while any(streams.values()):
        home = draw(st.sampled_from(sorted(h for h, msgs in streams.items() if msgs)))
        arrivals.append((home, streams[home].pop(0)))
    return path, arrivals, stays


ROAM = Roaming(radius_m=5000.0)
KEY = ("c1", "s1")


@given(_home_streams())
def test_each_homes_last_word_stands_whatever_the_interleaving(
    case: tuple[list[str], list[tuple[str, PeerMessage]], bool],
) -> None:
    # A subscriber moving mid -> west -> mid: west's announcement can reach east
    # after mid's renewal; west's withdrawal must then not take the renewal.
    path, arrivals, stays = case
    east = core("east", "flooding-subscriptions")
    last_word: dict[str, PeerMessage] = {}
    for src, msg in arrivals:
        east.on_message(src, msg)
        if not isinstance(msg, RelocateMsg):
            last_word[src] = msg
        # Matching uses a copy that some home announced and has not withdrawn.
        home = east.remote_home(KEY)
        assert (home is None) == (KEY not in east.remote)
        assert home is None or isinstance(last_word[home], SubscribeMsg)
        assert all(
            (east.remote_copy(KEY, h) is not None) == isinstance(m, SubscribeMsg)
            for h, m in last_word.items()
        )
    if stays:
        held = east.remote.get(KEY)
        assert east.remote_home(KEY) == path[-1] and held is not None
        assert held.topic_filter == f"a/{len(path) - 1}"  # the renewal, as last placed
        moved = [m.at for _, m in arrivals if isinstance(m, RelocateMsg)]
        last = len(path) - 1
        assert held.at == (latlon(last, 1) if latlon(last, 1) in moved else latlon(last, 0))
    else:
        assert KEY not in east.remote and east.remote_home(KEY) is None
    assert not east._shadowed  # nothing left over once every link has delivered


def test_a_late_announcement_and_withdrawal_leave_the_renewal() -> None:
    east = core("east", "flooding-subscriptions")
    sub = Subscription("s1", "c1", "a", None)
    east.on_message("mid", SubscribeMsg(sub, "mid"))
    east.on_message("mid", UnsubscribeMsg(sub.key, "mid"))  # moved to west
    east.on_message("mid", SubscribeMsg(sub, "mid"))  # and back: renewed at mid
    east.on_message("west", SubscribeMsg(sub, "west"))  # west's, late
    assert east.remote_home(sub.key) == "west"  # the newest word, for now
    east.on_message("west", UnsubscribeMsg(sub.key, "west"))
    assert east.remote_home(sub.key) == "mid" and sub.key in east.remote
    east.replace_remote("mid", [])
    assert sub.key not in east.remote and not east._shadowed
