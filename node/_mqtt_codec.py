"""MQTT 3.1.1 and 5.0 packets: the subset a QoS 0/1 broker needs, both directions.

Pure and synchronous (bytes in, dataclasses out, and back). `PacketReader`
frames packets off a byte stream (TCP or WebSocket). A packet
that breaks the specification raises `PacketError` carrying the MQTT 5
reason code (0x81 malformed packet, 0x82 protocol error, 0x95 packet too
large); the listener answers with it (MQTT 5) or just closes (3.1.1).

Why our own codec rather than a library's: the maintained Python brokers'
codecs (amqtt) speak 3.1.1 only, and the 5.0 clients (paho-mqtt, gmqtt)
encode the client side and decode the server side, the opposite of what a
broker needs. What a QoS 0/1 broker needs fits in this file, and it is
tested against paho-mqtt and mosquitto's clients (docs/mqtt.md).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

# Packet types (fixed header, high nibble).
CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14
AUTH = 15

MQTT_311 = 4
MQTT_5 = 5
PROTOCOL_NAMES = {MQTT_311: "MQTT", MQTT_5: "MQTT"}

# MQTT 5 reason codes used by the broker.
SUCCESS = 0x00
GRANTED_QOS_1 = 0x01
DISCONNECT_WITH_WILL = 0x04
NO_SUBSCRIPTION_EXISTED = 0x11
UNSPECIFIED_ERROR = 0x80
MALFORMED_PACKET = 0x81
PROTOCOL_ERROR = 0x82
IMPLEMENTATION_SPECIFIC_ERROR = 0x83
UNSUPPORTED_PROTOCOL_VERSION = 0x84
CLIENT_IDENTIFIER_NOT_VALID = 0x85
BAD_USER_NAME_OR_PASSWORD = 0x86
NOT_AUTHORIZED = 0x87
SERVER_UNAVAILABLE = 0x88
SERVER_SHUTTING_DOWN = 0x8B
KEEP_ALIVE_TIMEOUT = 0x8D
SESSION_TAKEN_OVER = 0x8E
TOPIC_FILTER_INVALID = 0x8F
TOPIC_NAME_INVALID = 0x90
PACKET_TOO_LARGE = 0x95
QUOTA_EXCEEDED = 0x97
PAYLOAD_FORMAT_INVALID = 0x99
RETAIN_NOT_SUPPORTED = 0x9A
QOS_NOT_SUPPORTED = 0x9B
USE_ANOTHER_SERVER = 0x9C
SERVER_MOVED = 0x9D
SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1

# MQTT 3.1.1 CONNACK return codes (and the SUBACK failure code).
V311_REFUSED_PROTOCOL = 0x01
V311_REFUSED_IDENTIFIER = 0x02
V311_REFUSED_UNAVAILABLE = 0x03
V311_REFUSED_CREDENTIALS = 0x04
V311_REFUSED_NOT_AUTHORIZED = 0x05
V311_SUBACK_FAILURE = 0x80

# MQTT 5 properties: identifier -> (name, type).
PAYLOAD_FORMAT_INDICATOR = 0x01
MESSAGE_EXPIRY_INTERVAL = 0x02
CONTENT_TYPE = 0x03
RESPONSE_TOPIC = 0x08
CORRELATION_DATA = 0x09
SUBSCRIPTION_IDENTIFIER = 0x0B
SESSION_EXPIRY_INTERVAL = 0x11
ASSIGNED_CLIENT_IDENTIFIER = 0x12
SERVER_KEEP_ALIVE = 0x13
AUTHENTICATION_METHOD = 0x15
AUTHENTICATION_DATA = 0x16
REQUEST_PROBLEM_INFORMATION = 0x17
WILL_DELAY_INTERVAL = 0x18
REQUEST_RESPONSE_INFORMATION = 0x19
RESPONSE_INFORMATION = 0x1A
SERVER_REFERENCE = 0x1C
REASON_STRING = 0x1F
RECEIVE_MAXIMUM = 0x21
TOPIC_ALIAS_MAXIMUM = 0x22
TOPIC_ALIAS = 0x23
MAXIMUM_QOS = 0x24
RETAIN_AVAILABLE = 0x25
USER_PROPERTY = 0x26
MAXIMUM_PACKET_SIZE = 0x27
WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
SHARED_SUBSCRIPTION_AVAILABLE = 0x2A

_BYTE, _U16, _U32, _VARINT, _STR, _BIN, _PAIR = range(7)
_PROPERTY_TYPES = {
    PAYLOAD_FORMAT_INDICATOR: _BYTE,
    MESSAGE_EXPIRY_INTERVAL: _U32,
    CONTENT_TYPE: _STR,
    RESPONSE_TOPIC: _STR,
    CORRELATION_DATA: _BIN,
    SUBSCRIPTION_IDENTIFIER: _VARINT,
    SESSION_EXPIRY_INTERVAL: _U32,
    ASSIGNED_CLIENT_IDENTIFIER: _STR,
    SERVER_KEEP_ALIVE: _U16,
    AUTHENTICATION_METHOD: _STR,
    AUTHENTICATION_DATA: _BIN,
    REQUEST_PROBLEM_INFORMATION: _BYTE,
    WILL_DELAY_INTERVAL: _U32,
    REQUEST_RESPONSE_INFORMATION: _BYTE,
    RESPONSE_INFORMATION: _STR,
    SERVER_REFERENCE: _STR,
    REASON_STRING: _STR,
    RECEIVE_MAXIMUM: _U16,
    TOPIC_ALIAS_MAXIMUM: _U16,
    TOPIC_ALIAS: _U16,
    MAXIMUM_QOS: _BYTE,
    RETAIN_AVAILABLE: _BYTE,
    USER_PROPERTY: _PAIR,
    MAXIMUM_PACKET_SIZE: _U32,
    WILDCARD_SUBSCRIPTION_AVAILABLE: _BYTE,
    SUBSCRIPTION_IDENTIFIER_AVAILABLE: _BYTE,
    SHARED_SUBSCRIPTION_AVAILABLE: _BYTE,
}
MAX_REMAINING_LENGTH = 268_435_455


class PacketError(Exception):
    """A packet that breaks the specification; `code` is the MQTT 5 reason code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _malformed(message: str) -> PacketError:
    return PacketError(MALFORMED_PACKET, message)


def _protocol(message: str) -> PacketError:
    return PacketError(PROTOCOL_ERROR, message)


@dataclass
class Properties:
    """MQTT 5 properties of one packet: single-valued ones by id, user properties in order."""

    values: dict[int, Any] = field(default_factory=dict)
    user: list[tuple[str, str]] = field(default_factory=list)

    def get(self, prop: int, default: Any = None) -> Any:
        """The value of property `prop` (a `*_INTERVAL`, `REASON_STRING`, ... constant)."""
        return self.values.get(prop, default)

    def user_values(self, name: str) -> list[str]:
        """Every value of the user property `name`, in packet order."""
        return [v for k, v in self.user if k == name]


# -- primitive encoders and a reader --------------------------------------------


_ONE_BYTE = [bytes((i,)) for i in range(128)]  # the Variable Byte Integers of one byte


def encode_varint(n: int) -> bytes:
    """A Variable Byte Integer (1-4 bytes)."""
    if 0 <= n < 128:
        return _ONE_BYTE[n]
    if not 0 <= n <= MAX_REMAINING_LENGTH:
        raise ValueError(f"variable byte integer out of range: {n}")
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


_U16_BYTES = struct.Struct("!H")


def _str(s: str) -> bytes:
    data = s.encode("utf-8")
    if len(data) > 0xFFFF:
        raise ValueError("string longer than 65,535 bytes")
    return _U16_BYTES.pack(len(data)) + data


def _bin(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError("binary data longer than 65,535 bytes")
    return struct.pack("!H", len(b)) + b


def encode_properties(props: Properties | None) -> bytes:
    """The property section of an MQTT 5 packet (length prefix included)."""
    out = bytearray()
    if props is not None:
        for prop, value in props.values.items():
            kind = _PROPERTY_TYPES[prop]
            out.append(prop)
            if kind == _BYTE:
                out.append(value)
            elif kind == _U16:
                out += struct.pack("!H", value)
            elif kind == _U32:
                out += struct.pack("!I", value)
            elif kind == _VARINT:
                out += encode_varint(value)
            elif kind == _STR:
                out += _str(value)
            else:
                out += _bin(value)
        for name, value in props.user:
            out.append(USER_PROPERTY)
            out += _str(name)
            out += _str(value)
    return encode_varint(len(out)) + out


class _Reader:
    """Reads the variable header and payload of one packet, raising `PacketError`."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if self.left() < n:
            raise _malformed(f"{what}: packet ends early")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        value: int = struct.unpack("!H", self.take(2, what))[0]
        return value

    def u32(self, what: str) -> int:
        value: int = struct.unpack("!I", self.take(4, what))[0]
        return value

    def varint(self, what: str) -> int:
        value, shift = 0, 0
        for _ in range(4):
            b = self.byte(what)
            value += (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
        raise _malformed(f"{what}: variable byte integer longer than 4 bytes")

    def binary(self, what: str) -> bytes:
        return self.take(self.u16(what), what)

    def string(self, what: str) -> str:
        raw = self.binary(what)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed(f"{what}: not UTF-8") from None
        if "\x00" in text:
            raise _malformed(f"{what}: contains U+0000")
        return text

    def properties(self, what: str) -> Properties:
        size = self.varint(f"{what} length")
        end = self.pos + size
        if end > len(self.data):
            raise _malformed(f"{what}: longer than the packet")
        props = Properties()
        while self.pos < end:
            prop = self.varint(what)
            kind = _PROPERTY_TYPES.get(prop)
            if kind is None:
                raise _malformed(f"{what}: unknown property 0x{prop:02x}")
            name = f"{what} 0x{prop:02x}"
            if kind == _PAIR:
                props.user.append((self.string(name), self.string(name)))
                continue
            value: Any
            if kind == _BYTE:
                value = self.byte(name)
            elif kind == _U16:
                value = self.u16(name)
            elif kind == _U32:
                value = self.u32(name)
            elif kind == _VARINT:
                value = self.varint(name)
            elif kind == _STR:
                value = self.string(name)
            else:
                value = self.binary(name)
            if prop in props.values:
                raise _protocol(f"{what}: property 0x{prop:02x} given twice")
            props.values[prop] = value
        if self.pos != end:
            raise _malformed(f"{what}: a property runs past the property length")
        return props


class ByteReader(Protocol):
    """Where packets are read from: an `asyncio.StreamReader` (TCP) or a WebSocket's frames."""

    async def read(self, n: int) -> bytes:
        """The next bytes that arrived (about `n` at most); b"" once the stream has ended."""
        ...


_CHUNK = 1 << 16  # bytes asked of the stream at a time


class PacketReader:
    """Frames packets off a byte stream, reading it a chunk at a time.

    The packets of a chunk are handed out without awaiting the stream again,
    so a connection handles a burst of small packets in one go (and answers
    them in one write: `ready` says whether another packet is waiting).
    Memory: at most one packet (`max_size`) plus one chunk.
    """

    def __init__(self, stream: ByteReader, max_size: int) -> None:
        self._stream = stream
        self._max = max_size
        self._buf = bytearray()
        self._pos = 0
        self._next: tuple[int, int, bytes] | None = None

    def ready(self) -> bool:
        """Whether a whole packet is already buffered (`next` returns it without waiting).

        Raises:
            PacketError: the buffered header is malformed or announces a packet too large.
        """
        if self._next is None:
            self._next = self._parse()
        return self._next is not None

    async def next(self, timeout: float | None = None) -> tuple[int, int, bytes]:
        """The next packet: (type, fixed-header flags, the rest).

        Raises:
            asyncio.IncompleteReadError: the stream ended (at a packet boundary or not).
            TimeoutError: nothing arrived for `timeout` seconds while a packet was awaited.
            PacketError: a remaining length over 4 bytes or over `max_size`.
        """
        while not self.ready():
            async with asyncio.timeout(timeout):
                data = await self._stream.read(_CHUNK)
            if not data:
                raise asyncio.IncompleteReadError(bytes(self._buf[self._pos :]), None)
            if self._pos:
                del self._buf[: self._pos]
                self._pos = 0
            self._buf += data
        packet, self._next = self._next, None
        assert packet is not None
        return packet

    def _parse(self) -> tuple[int, int, bytes] | None:
        buf, pos = self._buf, self._pos
        i, length, shift = pos + 1, 0, 0
        while True:
            if i >= len(buf):
                return None
            b = buf[i]
            length += (b & 0x7F) << shift
            i += 1
            if not b & 0x80:
                break
            shift += 7
            if i - pos > 4:
                raise _malformed("remaining length longer than 4 bytes")
        if length > self._max:
            raise PacketError(PACKET_TOO_LARGE, f"packet of {length} bytes, limit {self._max}")
        if i + length > len(buf):
            return None
        self._pos = i + length
        first = buf[pos]
        return first >> 4, first & 0x0F, bytes(buf[i : self._pos])


def _packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes([kind << 4 | flags]) + encode_varint(len(body)) + body


# -- packets ----------------------------------------------------------------------


@dataclass
class Will:
    """The will message of a CONNECT."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=Properties)


@dataclass
class Connect:
    """CONNECT (client to server)."""

    client_id: str
    version: int = MQTT_5
    clean_start: bool = True
    keep_alive: int = 60
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    properties: Properties = field(default_factory=Properties)

    def encode(self) -> bytes:
        flags = 0x02 if self.clean_start else 0
        payload = _str(self.client_id)
        if self.will is not None:
            flags |= 0x04 | self.will.qos << 3 | (0x20 if self.will.retain else 0)
            if self.version == MQTT_5:
                payload += encode_properties(self.will.properties)
            payload += _str(self.will.topic) + _bin(self.will.payload)
        if self.username is not None:
            flags |= 0x80
            payload += _str(self.username)
        if self.password is not None:
            flags |= 0x40
            payload += _bin(self.password)
        body = _str("MQTT") + bytes([self.version, flags]) + struct.pack("!H", self.keep_alive)
        if self.version == MQTT_5:
            body += encode_properties(self.properties)
        return _packet(CONNECT, 0, body + payload)


@dataclass
class ConnAck:
    """CONNACK (server to client); `code` is a 3.1.1 return code or a 5.0 reason code."""

    code: int = SUCCESS
    session_present: bool = False
    properties: Properties = field(default_factory=Properties)

    def encode(self, version: int) -> bytes:
        body = bytes([1 if self.session_present else 0, self.code])
        if version == MQTT_5:
            body += encode_properties(self.properties)
        return _packet(CONNACK, 0, body)


@dataclass
class Publish:
    """PUBLISH (both directions)."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int = 0
    properties: Properties = field(default_factory=Properties)

    def encode(self, version: int) -> bytes:
        flags = (0x08 if self.dup else 0) | self.qos << 1 | (0x01 if self.retain else 0)
        parts = [_str(self.topic)]
        if self.qos:
            parts.append(_U16_BYTES.pack(self.packet_id))
        if version == MQTT_5:
            parts.append(encode_properties(self.properties))
        parts.append(self.payload)
        body = b"".join(parts)
        return b"".join((_ONE_BYTE[PUBLISH << 4 | flags], encode_varint(len(body)), body))


@dataclass
class PubAck:
    """PUBACK (and the other acknowledgements that carry only a packet id and a code)."""

    packet_id: int
    code: int = SUCCESS
    properties: Properties = field(default_factory=Properties)
    kind: int = PUBACK

    def encode(self, version: int) -> bytes:
        body = struct.pack("!H", self.packet_id)
        if version == MQTT_5 and (self.code or self.properties.values or self.properties.user):
            body += bytes([self.code]) + encode_properties(self.properties)
        return _packet(self.kind, 0x02 if self.kind == PUBREL else 0, body)


@dataclass
class Subscribe:
    """SUBSCRIBE: (topic filter, options byte) pairs; options hold the QoS in bits 0-1."""

    packet_id: int
    filters: list[tuple[str, int]]
    properties: Properties = field(default_factory=Properties)

    def encode(self, version: int) -> bytes:
        body = struct.pack("!H", self.packet_id)
        if version == MQTT_5:
            body += encode_properties(self.properties)
        for topic_filter, options in self.filters:
            body += _str(topic_filter) + bytes([options])
        return _packet(SUBSCRIBE, 0x02, body)


@dataclass
class SubAck:
    """SUBACK: one granted QoS or failure code per filter."""

    packet_id: int
    codes: list[int]
    properties: Properties = field(default_factory=Properties)

    def encode(self, version: int) -> bytes:
        body = struct.pack("!H", self.packet_id)
        if version == MQTT_5:
            body += encode_properties(self.properties)
        return _packet(SUBACK, 0, body + bytes(self.codes))


@dataclass
class Unsubscribe:
    """UNSUBSCRIBE."""

    packet_id: int
    filters: list[str]
    properties: Properties = field(default_factory=Properties)

    def encode(self, version: int) -> bytes:
        body = struct.pack("!H", self.packet_id)
        if version == MQTT_5:
            body += encode_properties(self.properties)
        for topic_filter in self.filters:
            body += _str(topic_filter)
        return _packet(UNSUBSCRIBE, 0x02, body)


@dataclass
class UnsubAck:
    """UNSUBACK (the reason codes only in MQTT 5)."""

    packet_id: int
    codes: list[int] = field(default_factory=list)
    properties: Properties = field(default_factory=Properties)

    def encode(self, version: int) -> bytes:
        body = struct.pack("!H", self.packet_id)
        if version == MQTT_5:
            body += encode_properties(self.properties) + bytes(self.codes)
        return _packet(UNSUBACK, 0, body)


@dataclass
class PingReq:
    """PINGREQ."""

    def encode(self, version: int) -> bytes:
        return _packet(PINGREQ, 0, b"")


@dataclass
class PingResp:
    """PINGRESP."""

    def encode(self, version: int) -> bytes:
        return _packet(PINGRESP, 0, b"")


@dataclass
class Disconnect:
    """DISCONNECT (both directions in MQTT 5; client to server only in 3.1.1)."""

    code: int = SUCCESS
    properties: Properties = field(default_factory=Properties)

    def encode(self, version: int) -> bytes:
        body = b""
        if version == MQTT_5 and (self.code or self.properties.values or self.properties.user):
            body = bytes([self.code]) + encode_properties(self.properties)
        return _packet(DISCONNECT, 0, body)


@dataclass
class Auth:
    """AUTH (MQTT 5 enhanced authentication; the broker does not offer it)."""

    code: int = SUCCESS
    properties: Properties = field(default_factory=Properties)


Packet = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)


# -- decoding -------------------------------------------------------------------


def decode_connect(flags: int, body: bytes) -> Connect:
    """A CONNECT of any version; an unknown protocol level raises code 0x84."""
    if flags:
        raise _malformed("CONNECT: fixed header flags must be 0")
    r = _Reader(body)
    name = r.string("protocol name")
    level = r.byte("protocol level")
    if name != "MQTT" or level not in (MQTT_311, MQTT_5):
        raise PacketError(
            UNSUPPORTED_PROTOCOL_VERSION, f"protocol {name!r} level {level}: speaks MQTT 4 and 5"
        )
    cflags = r.byte("connect flags")
    if cflags & 0x01:
        raise _malformed("CONNECT: reserved flag set")
    keep_alive = r.u16("keep alive")
    props = r.properties("CONNECT properties") if level == MQTT_5 else Properties()
    client_id = r.string("client identifier")
    will = None
    will_qos = cflags >> 3 & 0x03
    if cflags & 0x04:
        if will_qos == 3:
            raise _malformed("CONNECT: will QoS 3")
        will_props = r.properties("will properties") if level == MQTT_5 else Properties()
        will = Will(
            r.string("will topic"),
            r.binary("will payload"),
            will_qos,
            bool(cflags & 0x20),
            will_props,
        )
    elif will_qos or cflags & 0x20:
        raise _malformed("CONNECT: will QoS or retain without a will")
    username = r.string("user name") if cflags & 0x80 else None
    if cflags & 0x40 and level == MQTT_311 and username is None:
        raise _malformed("CONNECT: password without a user name")
    password = r.binary("password") if cflags & 0x40 else None
    if r.left():
        raise _malformed("CONNECT: bytes after the payload")
    return Connect(
        client_id, level, bool(cflags & 0x02), keep_alive, will, username, password, props
    )


def decode(kind: int, flags: int, body: bytes, version: int) -> Packet:
    """Decode a packet read by `PacketReader`, for a connection of protocol `version`.

    Raises:
        PacketError: malformed, or not allowed from a client.
    """
    if kind == CONNECT:
        raise _protocol("a second CONNECT")
    r = _Reader(body)
    v5 = version == MQTT_5
    if kind == PUBLISH:
        qos = flags >> 1 & 0x03
        if qos == 3:
            raise _malformed("PUBLISH: QoS 3")
        if qos == 0 and flags & 0x08:
            raise _malformed("PUBLISH: DUP set on QoS 0")
        topic = r.string("topic name")
        packet_id = r.u16("packet identifier") if qos else 0
        if qos and not packet_id:
            raise _malformed("PUBLISH: packet identifier 0")
        props = r.properties("PUBLISH properties") if v5 else Properties()
        return Publish(
            topic, r.data[r.pos :], qos, bool(flags & 0x01), bool(flags & 0x08), packet_id, props
        )
    if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        if flags != (0x02 if kind == PUBREL else 0):
            raise _malformed("acknowledgement: wrong fixed header flags")
        packet_id = r.u16("packet identifier")
        code = r.byte("reason code") if v5 and r.left() else SUCCESS
        props = r.properties("properties") if v5 and r.left() else Properties()
        return PubAck(packet_id, code, props, kind)
    if kind in (SUBSCRIBE, UNSUBSCRIBE):
        name = "SUBSCRIBE" if kind == SUBSCRIBE else "UNSUBSCRIBE"
        if flags != 0x02:
            raise _malformed(f"{name}: fixed header flags must be 0010")
        packet_id = r.u16("packet identifier")
        if not packet_id:
            raise _malformed(f"{name}: packet identifier 0")
        props = r.properties(f"{name} properties") if v5 else Properties()
        if kind == UNSUBSCRIBE:
            filters: list[str] = []
            while r.left():
                filters.append(r.string("topic filter"))
            if not filters:
                raise _protocol("UNSUBSCRIBE without a topic filter")
            return Unsubscribe(packet_id, filters, props)
        pairs: list[tuple[str, int]] = []
        while r.left():
            topic_filter = r.string("topic filter")
            options = r.byte("subscription options")
            if options & (0xC0 if v5 else 0xFC) or options & 0x03 == 3 or options >> 4 & 3 == 3:
                raise _malformed("SUBSCRIBE: reserved bits or QoS 3 in subscription options")
            pairs.append((topic_filter, options))
        if not pairs:
            raise _protocol("SUBSCRIBE without a topic filter")
        return Subscribe(packet_id, pairs, props)
    if kind == PINGREQ:
        if flags or body:
            raise _malformed("PINGREQ: flags or payload")
        return PingReq()
    if kind == DISCONNECT:
        if flags:
            raise _malformed("DISCONNECT: fixed header flags must be 0")
        code = r.byte("reason code") if v5 and r.left() else SUCCESS
        props = r.properties("DISCONNECT properties") if v5 and r.left() else Properties()
        return Disconnect(code, props)
    if kind == AUTH and v5:
        code = r.byte("reason code") if r.left() else SUCCESS
        props = r.properties("AUTH properties") if r.left() else Properties()
        return Auth(code, props)
    raise _protocol(f"packet type {kind} is not sent by clients")


def decode_server(kind: int, flags: int, body: bytes, version: int) -> Packet:
    """Decode a packet a server sends (for tests and tools: CONNACK, SUBACK, ...)."""
    r = _Reader(body)
    v5 = version == MQTT_5
    if kind == CONNACK:
        present = bool(r.byte("acknowledge flags") & 0x01)
        code = r.byte("reason code")
        return ConnAck(code, present, r.properties("CONNACK properties") if v5 else Properties())
    if kind == SUBACK:
        packet_id = r.u16("packet identifier")
        props = r.properties("SUBACK properties") if v5 else Properties()
        return SubAck(packet_id, list(r.data[r.pos :]), props)
    if kind == UNSUBACK:
        packet_id = r.u16("packet identifier")
        props = r.properties("UNSUBACK properties") if v5 else Properties()
        return UnsubAck(packet_id, list(r.data[r.pos :]), props)
    if kind == PINGRESP:
        return PingResp()
    return decode(kind, flags, body, version)


def split_packets(data: bytes) -> Iterable[tuple[int, int, bytes]]:
    """The (type, flags, body) of each whole packet in `data` (for tests and tools)."""
    pos = 0
    while pos < len(data):
        first = data[pos]
        r = _Reader(data[pos + 1 :])
        length = r.varint("remaining length")
        start = pos + 1 + r.pos
        if start + length > len(data):
            raise _malformed("packet ends early")
        yield first >> 4, first & 0x0F, data[start : start + length]
        pos = start + length
