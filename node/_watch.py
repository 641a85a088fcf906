"""A value loaded from a file and loaded again when the file changes.

Why: a broker's security files change while it runs (issue #12): the policy is
edited, the identity provider's signing key is rotated. Both follow their
file the same way, here (the TLS certificates have their own watch in
`_tls.CertificateWatch`, since gRPC asks for them on each handshake and three
files change together).

A change is seen by the file's modification time, size or inode (write a new
file and rename it over the old one, as editors and Kubernetes volume updates
do), looked at no more than once per interval. A new file that does not load
is logged once per change and the previous value stays in force.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from geofed.routing import GeofedError

T = TypeVar("T")

Stamp = tuple[int, int, int] | None


def file_stamp(path: Path) -> Stamp:
    """(modification time, size, inode) of `path`; None when it cannot be looked at."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class WatchedFile(Generic[T]):
    """`load(path)`, done again when the file at `path` changes (see the module docs)."""

    def __init__(
        self,
        path: str | Path,
        load: Callable[[Path], T],
        what: str,
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        """Load the file now.

        Args:
            path: the file.
            load: reads it; raises a `GeofedError` (naming the problem) when it cannot.
            what: how log lines name the file (``policy``, ``token key``).
            check_interval_s: look at the file at most this often (0: at every `value`).
            clock: monotonic seconds (tests may drive it).
            logger: where reloads and failed reloads are logged.

        Raises:
            GeofedError: whatever `load` raises: the file does not load now.
        """
        self.path = Path(path)
        self._load = load
        self._what = what
        self._interval = check_interval_s
        self._clock = clock
        self._log = logger or logging.getLogger("geofed.node.watch")
        self._stamp = file_stamp(self.path)
        self._value = load(self.path)
        self._checked = clock()
        self.error: str | None = None
        """Why the file's current content is not in force (None: it is)."""
        self.loads = 1
        """How many times the file was loaded."""

    @property
    def value(self) -> T:
        """The value in force, after loading the file again if it changed."""
        now = self._clock()
        if now - self._checked < self._interval:
            return self._value
        self._checked = now
        stamp = file_stamp(self.path)
        if stamp == self._stamp:
            return self._value
        self._stamp = stamp  # a file that fails is not tried again until it changes again
        try:
            self._value = self._load(self.path)
        except GeofedError as exc:
            self.error = str(exc)
            self._log.warning(
                "%s %s not reloaded, the previous one stays: %s", self._what, self.path, exc
            )
        else:
            self.error = None
            self.loads += 1
            self._log.info("%s %s reloaded", self._what, self.path)
        return self._value
