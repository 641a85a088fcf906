"""The node message trace (docs/design.md §4): one JSON line per inter-broker message sent.

Records are buffered in memory and written in blocks, so tracing costs one
small dict per message on the hot path. The buffer is bounded: when the disk
cannot keep up the oldest unwritten block is written synchronously.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

_FLUSH_EVERY = 2048


class MessageTrace:
    """Appends message records to a JSON Lines file."""

    def __init__(self, path: str | Path, broker_id: str, strategy: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8", buffering=1 << 16)
        self._src = broker_id
        self._strategy = strategy
        self._buffer: list[dict[str, Any]] = []

    def record(self, dst: str, kind: str, ids: list[str], topic: str | None, size: int) -> None:
        """Remember one sent message."""
        self._buffer.append(
            {
                "t": time.time(),
                "strategy": self._strategy,
                "src": self._src,
                "dst": dst,
                "kind": kind,
                "ids": ids,
                "topic": topic,
                "bytes": size,
            }
        )
        if len(self._buffer) >= _FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Write buffered records."""
        if self._file is None or not self._buffer:
            return
        self._file.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self._buffer))
        self._buffer.clear()
        self._file.flush()

    def close(self) -> None:
        """Flush and close (idempotent)."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
