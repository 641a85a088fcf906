"""The MQTT packet codec (`geofed.node._mqtt_codec`): bytes from the spec, paho's bytes, errors."""

from __future__ import annotations

import asyncio

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from geofed.node import _mqtt_codec as mq


def one(data: bytes, version: int = mq.MQTT_5) -> mq.Packet:
    (kind, flags, body), *rest = mq.split_packets(data)
    assert not rest
    if kind == mq.CONNECT:
        return mq.decode_connect(flags, body)
    return mq.decode_server(kind, flags, body, version)


@pytest.mark.parametrize(
    ("n", "encoded"),
    [
        (0, b"\x00"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (16_383, b"\xff\x7f"),
        (16_384, b"\x80\x80\x01"),
        (268_435_455, b"\xff\xff\xff\x7f"),
    ],
)
def test_variable_byte_integers_as_the_spec_tabulates_them(n: int, encoded: bytes) -> None:
    assert mq.encode_varint(n) == encoded
    assert mq._Reader(encoded).varint("n") == n


def test_a_fifth_length_byte_is_malformed() -> None:
    with pytest.raises(mq.PacketError) as err:
        mq._Reader(b"\xff\xff\xff\xff\x01").varint("remaining length")
    assert err.value.code == mq.MALFORMED_PACKET


def test_a_311_connect_written_by_hand_decodes() -> None:
    data = b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x02c1"
    packet = one(data)
    assert packet == mq.Connect("c1", mq.MQTT_311, True, 60)
    assert packet.encode() == data


def test_every_client_packet_round_trips_in_both_versions() -> None:
    user = mq.Properties(user=[("geofed-location", "48.85,2.35"), ("k", "v")])
    for version in (mq.MQTT_311, mq.MQTT_5):
        props = user if version == mq.MQTT_5 else mq.Properties()
        will = mq.Will("status/c1", b"gone", 1, False, props)
        connect = mq.Connect("c1", version, False, 30, will, "alice", b"secret", props)
        assert one(connect.encode()) == connect
        packets: list[mq.Publish | mq.Subscribe | mq.Unsubscribe | mq.PubAck | mq.Disconnect] = [
            mq.Publish("a/b", b"\x00payload", 1, False, True, 7, props),
            mq.Publish("a/b", b"", 0),
            mq.Subscribe(3, [("a/+", 1), ("$SYS/#", 0)], props),
            mq.Unsubscribe(4, ["a/+"], props),
            mq.PubAck(7),
        ]
        for packet in packets:
            assert one(packet.encode(version), version) == packet
        assert isinstance(one(mq.PingReq().encode(version), version), mq.PingReq)
        disconnect = one(mq.Disconnect().encode(version), version)
        assert disconnect == mq.Disconnect()


def test_server_packets_round_trip_with_their_mqtt5_properties() -> None:
    ack = mq.ConnAck(
        mq.USE_ANOTHER_SERVER,
        False,
        mq.Properties({mq.SERVER_REFERENCE: "127.0.0.1:1884", mq.RETAIN_AVAILABLE: 0}),
    )
    assert one(ack.encode(mq.MQTT_5)) == ack
    assert one(mq.SubAck(5, [0, 1, 0x83]).encode(mq.MQTT_5)) == mq.SubAck(5, [0, 1, 0x83])
    assert one(mq.UnsubAck(6, [0, 0x11]).encode(mq.MQTT_5)) == mq.UnsubAck(6, [0, 0x11])
    # 3.1.1 UNSUBACK carries no codes; 3.1.1 CONNACK no properties.
    assert one(mq.UnsubAck(6, [0]).encode(mq.MQTT_311), mq.MQTT_311) == mq.UnsubAck(6)
    assert mq.ConnAck(mq.V311_REFUSED_UNAVAILABLE).encode(mq.MQTT_311) == b"\x20\x02\x00\x03"
    puback = mq.PubAck(9, mq.IMPLEMENTATION_SPECIFIC_ERROR, mq.Properties({mq.REASON_STRING: "x"}))
    assert one(puback.encode(mq.MQTT_5)) == puback
    reason = mq.Disconnect(mq.SERVER_MOVED, mq.Properties({mq.SERVER_REFERENCE: "h:1"}))
    assert one(reason.encode(mq.MQTT_5)) == reason


def test_properties_are_encoded_as_paho_encodes_them() -> None:
    paho = PahoProperties(PacketTypes.PUBLISH)
    paho.UserProperty = [("geofed-geofence", "circle:48.85,2.35,1000"), ("b", "c")]
    paho.MessageExpiryInterval = 120
    ours = mq.Properties(
        {mq.MESSAGE_EXPIRY_INTERVAL: 120},
        [("geofed-geofence", "circle:48.85,2.35,1000"), ("b", "c")],
    )
    assert sorted(mq.encode_properties(ours)) == sorted(paho.pack())  # the order may differ
    decoded = mq._Reader(paho.pack()).properties("p")
    assert decoded == ours
    assert decoded.user_values("geofed-geofence") == ["circle:48.85,2.35,1000"]


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (b"\x10\x0e\x00\x04MQTT\x03\x02\x00\x3c\x00\x02c1", mq.UNSUPPORTED_PROTOCOL_VERSION, "4"),
        (b"\x10\x0e\x00\x04MQTT\x04\x03\x00\x3c\x00\x02c1", mq.MALFORMED_PACKET, "reserved"),
        (b"\x10\x0e\x00\x04MQTT\x04\x42\x00\x3c\x00\x02c1", mq.MALFORMED_PACKET, "password"),
        (b"\x10\x0e\x00\x04MQTT\x04\x1e\x00\x3c\x00\x02c1", mq.MALFORMED_PACKET, "QoS 3"),
        (b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x02\xc3\x28", mq.MALFORMED_PACKET, "UTF-8"),
        (b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x02c\x00", mq.MALFORMED_PACKET, "U+0000"),
        (b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x05c1", mq.MALFORMED_PACKET, "ends early"),
    ],
)
def test_bad_connects_raise_the_reason_code(data: bytes, code: int, words: str) -> None:
    with pytest.raises(mq.PacketError) as err:
        one(data)
    assert err.value.code == code
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\x36\x05\x00\x01a\x00\x01", mq.MALFORMED_PACKET),  # PUBLISH QoS 3
        (b"\x38\x03\x00\x01a", mq.MALFORMED_PACKET),  # DUP on QoS 0
        (b"\x32\x05\x00\x01a\x00\x00", mq.MALFORMED_PACKET),  # QoS 1 with packet id 0
        (b"\x80\x06\x00\x01\x00\x01a\x00", mq.MALFORMED_PACKET),  # SUBSCRIBE flags 0000
        (b"\x82\x02\x00\x01", mq.PROTOCOL_ERROR),  # SUBSCRIBE without a filter
        (b"\x82\x06\x00\x01\x00\x01a\x03", mq.MALFORMED_PACKET),  # QoS 3 option
        (b"\x10\x00", mq.PROTOCOL_ERROR),  # a second CONNECT
        (b"\x20\x02\x00\x00", mq.PROTOCOL_ERROR),  # CONNACK from a client
    ],
)
def test_bad_311_packets_raise_the_reason_code(data: bytes, code: int) -> None:
    (kind, flags, body), *_ = mq.split_packets(data)
    with pytest.raises(mq.PacketError) as err:
        mq.decode(kind, flags, body, mq.MQTT_311)
    assert err.value.code == code


def test_a_property_given_twice_is_a_protocol_error_and_an_unknown_one_malformed() -> None:
    twice = b"\x0a" + b"\x02\x00\x00\x00\x01" * 2  # message expiry interval, twice
    with pytest.raises(mq.PacketError) as err:
        mq._Reader(twice).properties("p")
    assert err.value.code == mq.PROTOCOL_ERROR
    with pytest.raises(mq.PacketError) as err:
        mq._Reader(b"\x02\x7f\x00").properties("p")
    assert err.value.code == mq.MALFORMED_PACKET


def test_the_packet_reader_frames_packets_and_refuses_one_over_the_limit() -> None:
    async def run() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(mq.PingReq().encode(mq.MQTT_5) + mq.Publish("t", b"x" * 300).encode(4))
        reader.feed_eof()
        packets = mq.PacketReader(reader, 100)
        assert await packets.next() == (mq.PINGREQ, 0, b"")
        with pytest.raises(mq.PacketError) as err:
            await packets.next()
        assert err.value.code == mq.PACKET_TOO_LARGE
        closed = asyncio.StreamReader()
        closed.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await mq.PacketReader(closed, 100).next()

    asyncio.run(run())


class Chunks:
    """A byte stream that arrives in the given chunks (a ByteReader)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.reads = 0

    async def read(self, n: int) -> bytes:
        self.reads += 1
        return self.chunks.pop(0) if self.chunks else b""


def test_the_packet_reader_takes_packets_split_over_chunks_and_many_in_one() -> None:
    packets = [
        mq.Publish(f"t/{i}", bytes([i]) * (i * 37 % 200), 1, packet_id=i + 1) for i in range(60)
    ]
    data = b"".join(p.encode(mq.MQTT_5) for p in packets)

    async def run(chunks: list[bytes]) -> tuple[list[mq.Packet], int, bool]:
        stream = Chunks(chunks)
        reader = mq.PacketReader(stream, 1000)
        got = [mq.decode(*(await reader.next()), mq.MQTT_5) for _ in packets]
        return got, stream.reads, reader.ready()

    one_byte = [data[i : i + 1] for i in range(len(data))]
    assert asyncio.run(run(one_byte))[0] == packets
    got, reads, ready = asyncio.run(run([data]))
    assert (got, reads, ready) == (packets, 1, False)  # one read for the whole burst
    with pytest.raises(mq.PacketError) as err:
        asyncio.run(run([b"\x30\xff\xff\xff\xff\x01"]))
    assert err.value.code == mq.MALFORMED_PACKET
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(run([data[:-1]]))  # the stream ends inside a packet
