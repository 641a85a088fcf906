"""Refused TLS handshakes: every one counted, their log lines limited per reason."""

from __future__ import annotations

import logging

import pytest

from geofed.node._tls_accept import LOG_BURST, LOG_WINDOW_S, RefusalLog


def test_refusals_past_the_burst_are_held_and_said_in_one_line_after_the_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = logging.getLogger("geofed.test.refusals")
    refusals = RefusalLog(log, logging.WARNING, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger=log.name)
    for i in range(3 * LOG_BURST):  # a scanner's flood in one window
        refusals.refused("plaintext", "refusing connection %d (plaintext)", i)
    refusals.refused("expired", "refusing connection (expired)")  # another reason: logged
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"refusing connection {i} (plaintext)" for i in range(LOG_BURST)] + [
        "refusing connection (expired)"
    ]
    caplog.clear()
    now[0] = LOG_WINDOW_S - 0.001  # still the same window
    refusals.refused("plaintext", "refusing connection (plaintext, late)")
    assert caplog.records == []
    now[0] = LOG_WINDOW_S  # the next window: what was held, then the refusal
    refusals.refused("plaintext", "refusing connection (plaintext, next)")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            f"{2 * LOG_BURST + 1} more TLS handshakes refused (plaintext) were not logged",
        ),
        (logging.WARNING, "refusing connection (plaintext, next)"),
    ]
