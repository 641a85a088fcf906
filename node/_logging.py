"""Structured logs: one JSON object per line on stderr."""

from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    """Formats records as JSON with time, level, logger, broker and message."""

    def __init__(self, broker_id: str = "") -> None:
        super().__init__()
        self.broker_id = broker_id

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "broker": self.broker_id,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(level: str, broker_id: str = "") -> None:
    """Send geofed's logs to stderr as JSON lines at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(broker_id))
    root = logging.getLogger("geofed")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
