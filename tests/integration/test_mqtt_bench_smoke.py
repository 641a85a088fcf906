"""The MQTT benchmark (``python -m geofed.bench.mqtt_bench``) run tiny, so it cannot rot.

Both brokers really run (a geofed node and Debian's mosquitto, which .ci/run
installs), both QoS levels, a few hundred events: the record names the
command, the machine and the broker, geofed held its geofenced subscriptions
and delivered exactly the events (and probes) the subscriber counted, and
each QoS has a row with both rates and their ratio. The figures themselves
are not checked: performance is measured in bench/, not asserted in tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from geofed.bench.mqtt_bench import main

pytestmark = pytest.mark.integration


def test_a_tiny_mqtt_bench_records_both_brokers_and_their_ratio(tmp_path: Path) -> None:
    out = tmp_path / "mqtt.md"
    argv = ["--events", "300", "--subs", "20", "--publishers", "2", "--rounds", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# MQTT throughput: one geofed node next to Mosquitto")
    assert "Command: `python -m geofed.bench.mqtt_bench --events 300 --subs 20" in text
    assert "Machine: " in text and "Load average" in text
    assert re.search(r"Broker: mosquitto version \d", text), text
    held = re.search(r"geofed: 20 geofenced subscriptions held, ([\d,]+) deliveries", text)
    assert held is not None, text
    assert int(held.group(1).replace(",", "")) >= 2 * 300  # both QoS runs, probes beside
    for qos in (0, 1):
        row = re.search(
            rf"^\| {qos} \| ([\d,]+) \| ([\d,]+) \| [\d,]+ \| [\d,]+ \| ([\d.]+)× "
            r"\| ([\d,]+ \| [\d,]+ \| [\d.]+×|– \| – \| –) \|$",
            text,
            re.M,
        )
        assert row is not None, text
        geofed_rate, mosquitto_rate, ratio, _ = row.groups()
        expected = int(geofed_rate.replace(",", "")) / int(mosquitto_rate.replace(",", ""))
        assert float(ratio) == pytest.approx(expected, abs=0.01)
