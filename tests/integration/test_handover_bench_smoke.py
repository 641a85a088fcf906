"""The handover benchmark (``python -m geofed.bench.handover_bench``) run tiny, so it
cannot rot: an MQTT client moved between geofed brokers, and between Debian's
Mosquitto brokers bridged to a hub (which .ci/run installs). Each run prints its
table; the figures themselves are not checked (performance is measured in bench/,
not asserted in tests), only that the row is there and the client received events.
"""

from __future__ import annotations

import re

import pytest

from geofed.bench.handover_bench import main

pytestmark = pytest.mark.integration

TINY = ["--moves", "2", "--rate", "50", "--subs", "3", "--gap-s", "0.2", "--no-record"]
ROW = (
    r"^\| {} \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| [\d.]+ \| [-\d,]+ \| [\d,]+"
    r" \| [\d.]+ \| [\d.]+ \|$"
)


def rows(text: str, name: str) -> list[tuple[int, int, int]]:
    found = re.findall(ROW.format(re.escape(name)), text, re.M)
    return [tuple(int(x.replace(",", "")) for x in row) for row in found]  # type: ignore[misc]


def test_a_tiny_run_moves_an_mqtt_client_between_geofed_brokers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--client", "mqtt", "--strategy", "event-geofence", *TINY]) == 0
    [(published, received, _missed)] = rows(capsys.readouterr().out, "event-geofence")[-1:]
    assert published > 0 and received > 0


def test_a_tiny_run_moves_an_mqtt_client_between_bridged_mosquitto_brokers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--peer", "mosquitto", *TINY]) == 0
    out = capsys.readouterr().out
    for session in ("persistent session", "clean session (Clean Start 1)"):
        [(published, received, _missed)] = rows(out, f"mosquitto star, {session}")[-1:]
        assert published > 0 and received > 0


def test_the_peer_run_refuses_geofed_only_settings() -> None:
    with pytest.raises(SystemExit):
        main(["--peer", "mosquitto", "--hold-s", "0", "--no-record"])
