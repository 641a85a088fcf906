"""Third-party brokers on loopback, for side-by-side benchmarks and bridges.

`Mosquitto` and `NatsServer` start Debian's ``mosquitto`` / ``nats-server``
binary on a free loopback port with a configuration file generated in a
temporary folder, wait until the broker answers (a TCP connection that
MQTT's CONNECT gets a CONNACK on, NATS's INFO line: on state, never a fixed
sleep), and on exit stop the process and remove the folder::

    with Mosquitto() as mqtt:
        client.connect(mqtt.host, mqtt.port)

The brokers run with their defaults but for what a benchmark on loopback
needs (anonymous access, no persistence); `Mosquitto` also runs with a store
that survives its restart, one password user or a TLS-only listener, as the
bridge's tests need. A missing binary is a `BrokerUnavailable` naming the
Debian package.
"""

from __future__ import annotations

import getpass
import json
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

from geofed.routing import InvalidInput

from .local import free_ports

__all__ = ["BrokerUnavailable", "Mosquitto", "NatsServer", "nats_subject"]

_POLL_S = 0.02  # between connection attempts while a broker starts


class BrokerUnavailable(RuntimeError):
    """The broker's binary is missing or it did not start."""


class _Broker:
    """A broker process on 127.0.0.1 with a generated configuration (subclasses fill in)."""

    name = ""
    binary = ""
    package = ""

    def __init__(
        self,
        extra: list[str] | None = None,
        start_timeout: float = 30.0,
        port: int = 0,
        workdir: Path | None = None,
    ) -> None:
        self.extra = list(extra or [])  # more lines for the configuration file
        self.host = "127.0.0.1"
        self.port = port  # 0: a free one is picked at the first start, kept by restarts
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        # Given: the caller's folder, kept across restarts (and never removed).
        self._own_workdir = workdir
        self.workdir: Path | None = workdir

    @property
    def address(self) -> str:
        """``host:port`` of its client listener."""
        return f"{self.host}:{self.port}"

    def config(self, workdir: Path) -> list[str]:
        """Write the configuration into `workdir`; return the command line."""
        raise NotImplementedError

    def answers(self, sock: socket.socket) -> bool:
        """Whether the broker on the connected `sock` speaks its protocol."""
        raise NotImplementedError

    @classmethod
    def executable(cls) -> str:
        """The broker binary's path (Debian puts some in /usr/sbin)."""
        exe = shutil.which(cls.binary) or shutil.which(cls.binary, path="/usr/sbin:/usr/bin")
        if exe is None:
            raise BrokerUnavailable(
                f"{cls.binary} not found: install Debian's {cls.package} package"
            )
        return exe

    def start(self) -> Self:
        """Start the broker and wait until it answers on its port."""
        exe = self.executable()
        if self._own_workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"geofed-{self.name}-")
            self.workdir = Path(self._tmp.name)
        assert self.workdir is not None
        if not self.port:
            self.port = free_ports(1)[0]
        cmd = [exe, *self.config(self.workdir)]
        log = (self.workdir / "broker.log").open("wb")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.process.poll() is not None:
                raise BrokerUnavailable(
                    f"{self.name} exited with status {self.process.returncode}: {self.log()}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=2.0) as sock:
                    sock.settimeout(2.0)
                    if self.answers(sock):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BrokerUnavailable(
                    f"{self.name} did not answer on {self.address} within"
                    f" {self.start_timeout} s: {self.log()}"
                )
            time.sleep(_POLL_S)

    def log(self) -> str:
        """The tail of the broker's output."""
        if self.workdir is None:
            return ""
        path = self.workdir / "broker.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self) -> None:
        """Stop the process (terminate, then kill) and remove the temporary folder."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# MQTT 3.1.1 CONNECT: clean session, keepalive 10 s, client id "ready".
_MQTT_CONNECT = bytes([0x10, 17, 0, 4, *b"MQTT", 4, 0x02, 0, 10, 0, 5, *b"ready"])


def _connack(sock: socket.socket) -> bool:
    """MQTT CONNECT gets a CONNACK on `sock` (a refusal for want of a password too)."""
    sock.sendall(_MQTT_CONNECT)
    return sock.recv(4)[:1] == b"\x20"


class Mosquitto(_Broker):
    """Debian's ``mosquitto`` (MQTT 3.1.1 / 5.0) on a free loopback port.

    Args:
        extra: more lines for ``mosquitto.conf`` (e.g. ``max_queued_messages 0``).
        workdir: keep the configuration, log and (`persistent`) store here
            rather than in a temporary folder; with `persistent`, a restart
            (`stop`, then `start`: SIGTERM, on which mosquitto writes its
            store) keeps sessions and their queued messages.
        password: (user, password): that one user may connect, nobody else.
        tls: a folder with ``ca.pem``, ``cert.pem`` and ``key.pem``: the listener
            speaks TLS only.
    """

    name = "mosquitto"
    binary = "mosquitto"
    package = "mosquitto"

    def __init__(
        self,
        extra: list[str] | None = None,
        start_timeout: float = 30.0,
        port: int = 0,
        workdir: Path | None = None,
        persistent: bool = False,
        password: tuple[str, str] | None = None,
        tls: Path | None = None,
    ) -> None:
        super().__init__(extra, start_timeout, port, workdir)
        if persistent and workdir is None:
            raise InvalidInput("workdir", "a persistent mosquitto needs a folder of its own")
        self.persistent = persistent
        self.password = password
        self.tls = tls

    @property
    def tls_ca(self) -> Path | None:
        """The CA a client trusts to reach a TLS listener."""
        return None if self.tls is None else self.tls / "ca.pem"

    def config(self, workdir: Path) -> list[str]:
        conf = workdir / "mosquitto.conf"
        lines = [f"listener {self.port} {self.host}"]
        if self.password is None:
            lines.append("allow_anonymous true")
        else:
            users = workdir / "passwd"
            subprocess.run(
                ["mosquitto_passwd", "-b", "-c", str(users), *self.password],
                check=True,
                capture_output=True,
                timeout=self.start_timeout,
            )
            lines += ["allow_anonymous false", f"password_file {users}"]
        if self.tls is not None:
            lines += [
                f"cafile {self.tls}/ca.pem",
                f"certfile {self.tls}/cert.pem",
                f"keyfile {self.tls}/key.pem",
            ]
        if self.persistent:
            lines += ["persistence true", f"persistence_location {workdir}/"]
        else:
            lines.append("persistence false")
        lines += [
            # Run as root, mosquitto would switch to its own user, which cannot
            # write the caller's folder.
            f"user {getpass.getuser()}",
            "log_dest stdout",
            "log_type error",
            "log_type warning",
            *self.extra,
        ]
        conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return ["-c", str(conf)]

    @staticmethod
    def bridge(leaf: str, hub: str, address: str, qos: int) -> list[str]:
        """``mosquitto.conf`` lines bridging broker `leaf` to broker `hub` at `address`:
        every topic both ways (``topic # both``) at `qos`, a clean bridge session."""
        return [
            f"connection {leaf}-to-{hub}",
            f"address {address}",
            f"topic # both {qos}",
            "cleansession true",
            "try_private true",
            "notifications false",
            "restart_timeout 1",
            f"remote_clientid bridge-{leaf}",
        ]

    def answers(self, sock: socket.socket) -> bool:
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls_ca)
            context.check_hostname = False
            with context.wrap_socket(sock) as sealed:
                return _connack(sealed)
        return _connack(sock)


class NatsServer(_Broker):
    """Debian's ``nats-server`` on a free loopback port (no JetStream, no cluster).

    Args:
        extra: more lines for the configuration file (a ``gateway`` block, ...).
        monitor: also serve the HTTP monitoring endpoints (``/varz``, ``/gatewayz``)
            on a free loopback port, read with `monitor`.
    """

    name = "nats-server"
    binary = "nats-server"
    package = "nats-server"

    def __init__(
        self,
        extra: list[str] | None = None,
        start_timeout: float = 30.0,
        port: int = 0,
        monitor: bool = False,
    ) -> None:
        super().__init__(extra, start_timeout, port)
        self.monitor_port = free_ports(1)[0] if monitor else 0

    def monitor(self, path: str) -> Any:
        """The JSON of a monitoring endpoint, e.g. ``gatewayz?accs=1``."""
        if not self.monitor_port:
            raise BrokerUnavailable(f"{self.name} runs without monitoring (monitor=True)")
        url = f"http://{self.host}:{self.monitor_port}/{path}"
        with urllib.request.urlopen(url, timeout=30.0) as reply:
            return json.load(reply)

    def config(self, workdir: Path) -> list[str]:
        conf = workdir / "nats.conf"
        lines = [f'listen: "{self.host}:{self.port}"', *self.extra]
        if self.monitor_port:
            lines.append(f'http: "{self.host}:{self.monitor_port}"')
        conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return ["-c", str(conf)]

    def answers(self, sock: socket.socket) -> bool:
        return sock.recv(5) == b"INFO "


def nats_subject(mqtt: str, field: str = "topic") -> str:
    """The NATS subject (or wildcard subject) of an MQTT topic (or filter).

    Levels become tokens, ``+`` becomes ``*`` and ``#`` ``>``. (On a filter
    ``a/#`` NATS's ``a.>`` does not match ``a`` itself: traffic with a fixed
    number of levels, as the benchmarks', is unaffected.)

    Raises:
        InvalidInput: naming `field` when a level is empty or holds what a NATS
            token cannot (``.``, ``*``, ``>``, white space).
    """
    out = []
    for level in mqtt.split("/"):
        if level in ("+", "#"):
            out.append("*" if level == "+" else ">")
        elif not level or any(c in level for c in ".*> \t\r\n"):
            raise InvalidInput(field, f"level {level!r} cannot be a NATS subject token")
        else:
            out.append(level)
    return ".".join(out)
