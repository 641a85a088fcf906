"""A TCP fault proxy for a peer link: pass traffic, cut the link, or make it flap.

`LocalFederation(links=True)` puts one `FaultProxy` on the link of every
broker pair: the broker whose id sorts first dials (docs/design.md §6), so
its copy of the federation file points that peer's endpoint at the proxy,
which forwards to the peer's real port. The federation digest leaves
endpoints out (§2), so the copies still agree.

Modes:

* ``pass``: bytes flow both ways;
* ``partition``: every open connection is reset and new ones are closed as
  soon as they are accepted (the dialler sees its link fail and backs off);
* ``blackhole``: connections stay open but nothing is forwarded, and new ones
  are accepted and held (only the link heartbeat notices);
* ``hold``: connections stay open and what they carry waits, in order, until
  the mode changes: forwarded then (``pass``), or dropped (a slow link, whose
  messages arrive late but arrive, as long as the peers' timeouts allow);
* flapping (`FaultProxy.flap`): partition for a while, pass until the link
  has come back and carried traffic for a while, and again, until `heal`.

The proxies run on an event loop of their own in a daemon thread
(`ProxyHost`), so that a synchronous caller and an asyncio one drive them
alike; every public method of `FaultProxy` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
Mode = Literal["pass", "partition", "blackhole", "hold"]
MODES: tuple[Mode, ...] = ("pass", "partition", "blackhole", "hold")
TapFactory = Callable[[], Callable[[int, bytes], None]]
_CHUNK = 65536
_CALL_TIMEOUT_S = 10.0


class _Pipe:
    """One proxied connection: two pumps copying bytes unless the proxy says otherwise."""

    def __init__(
        self,
        proxy: FaultProxy,
        down: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.writers = (down[1], up[1])
        self.flowed = [False, False]  # bytes forwarded towards the peer, and back
        self.tap = proxy.tap() if proxy.tap is not None else None
        self.tasks = [
            asyncio.create_task(self._pump(down[0], up[1], 0)),
            asyncio.create_task(self._pump(up[0], down[1], 1)),
        ]

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: int) -> None:
        try:
            while data := await src.read(_CHUNK):
                if self.proxy.mode == "hold":
                    self.proxy.held += 1
                    async with self.proxy._mode_changed:
                        await self.proxy._mode_changed.wait_for(lambda: self.proxy.mode != "hold")
                if self.proxy.mode != "pass":
                    self.proxy.dropped += len(data)  # read and dropped: the sender never blocks
                    continue
                if self.tap is not None:
                    self.tap(way, data)
                dst.write(data)
                await dst.drain()
                self.flowed[way] = True
                self.proxy._flowed.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.cut(reset=False)

    def cut(self, reset: bool) -> None:
        """Close both sockets (`reset`: abort them, as a broken network would)."""
        for w in self.writers:
            if reset:
                w.transport.abort()
            else:
                w.close()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self.proxy._pipes.discard(self)


class FaultProxy:
    """Forwards one listening port on 127.0.0.1 to `target`; see the module docs for the modes.

    Made and started by `ProxyHost.add`; `address` is where it listens.
    """

    def __init__(
        self, host: ProxyHost, name: str, target: str, tap: TapFactory | None = None
    ) -> None:
        self.name = name
        """What it stands for, e.g. ``eu->us``."""
        self.target = target
        """``host:port`` it forwards to."""
        self.address = ""
        """``127.0.0.1:port`` it listens on."""
        self.mode: Mode = "pass"
        self.accepted = 0
        """Connections accepted, refused ones included."""
        self.dropped = 0
        """Bytes read and not forwarded (blackholed)."""
        self.held = 0
        """Chunks that waited in ``hold`` mode."""
        self.cuts = 0
        """Times the link was partitioned (one per flap)."""
        self.flaps = 0
        """Flap cycles completed: cut, then back up and carrying traffic."""
        self.tap = tap
        """Makes, per connection, a function seeing every chunk forwarded (way 0:
        towards `target`, 1: back), on the proxies' loop: protocol counters."""
        self._host = host
        self._server: asyncio.Server | None = None
        self._pipes: set[_Pipe] = set()
        self._flowed = asyncio.Event()
        self._mode_changed = asyncio.Condition()
        self._flapper: asyncio.Task[None] | None = None

    # -- from any thread ---------------------------------------------------

    def set_mode(self, mode: Mode) -> None:
        """Switch to `mode` (stops flapping)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._host.call(self._set_mode(mode, stop_flapping=True))

    def partition(self) -> None:
        """Cut the link: reset open connections, refuse new ones."""
        self.set_mode("partition")

    def heal(self) -> None:
        """Let traffic pass again (and stop flapping)."""
        self.set_mode("pass")

    def hold(self) -> None:
        """Keep what the link carries from now on until `heal` (it then arrives, in order)."""
        self.set_mode("hold")

    def flap(self, down_s: float = 0.3, up_s: float = 0.3) -> None:
        """Alternate: partitioned for `down_s`, then passing until the link is back
        (a new connection carried bytes both ways) and `up_s` more, and again."""
        self._host.call(self._start_flapping(down_s, up_s))

    # -- on the host's loop ----------------------------------------------------

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode == "partition":
            writer.transport.abort()
            return
        host, port = self.target.rsplit(":", 1)
        try:
            up = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.transport.abort()  # the peer is down: so is the link
            return
        self._pipes.add(_Pipe(self, (reader, writer), up))

    async def _set_mode(self, mode: Mode, stop_flapping: bool) -> None:
        if stop_flapping and self._flapper is not None:
            self._flapper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flapper
            self._flapper = None
        if mode == "partition" and self.mode != "partition":
            self.cuts += 1
            for pipe in list(self._pipes):
                pipe.cut(reset=True)
        self.mode = mode
        async with self._mode_changed:
            self._mode_changed.notify_all()  # held chunks go on (or are dropped)

    async def _start_flapping(self, down_s: float, up_s: float) -> None:
        await self._set_mode("pass", stop_flapping=True)
        self._flapper = asyncio.create_task(self._flap(down_s, up_s), name=f"flap-{self.name}")

    async def _flap(self, down_s: float, up_s: float) -> None:
        while True:
            await self._set_mode("partition", stop_flapping=False)
            await asyncio.sleep(down_s)
            await self._set_mode("pass", stop_flapping=False)
            while not any(all(p.flowed) for p in self._pipes):
                self._flowed.clear()
                await self._flowed.wait()
            await asyncio.sleep(up_s)
            self.flaps += 1

    async def _close(self) -> None:
        await self._set_mode("partition", stop_flapping=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class ProxyHost:
    """An event loop in a daemon thread that runs fault proxies (`close` ends it)."""

    def __init__(self) -> None:
        self.proxies: dict[str, FaultProxy] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the proxies' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CALL_TIMEOUT_S)

    def add(self, name: str, target: str, tap: TapFactory | None = None) -> FaultProxy:
        """A started proxy named `name` forwarding to `target` (`tap`: see `FaultProxy.tap`)."""
        proxy = FaultProxy(self, name, target, tap)
        self.call(proxy._start())
        self.proxies[name] = proxy
        return proxy

    def close(self) -> None:
        """Close every proxy (their connections are reset) and stop the loop (idempotent)."""
        if self._loop.is_closed():
            return
        for proxy in self.proxies.values():
            self.call(proxy._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


__all__ = ["MODES", "FaultProxy", "Mode", "ProxyHost"]
