"""Node configuration: precedence flag > env > file > default, errors naming the field."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from node_fixtures import unstarted_node

from geofed.node import NodeConfig, add_arguments, from_args
from geofed.routing import AdaptiveConfig, InvalidInput

BASE = {"broker_id": "eu", "federation": "f.geojson"}


def test_defaults_and_precedence(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(
        json.dumps(
            {"broker_id": "file", "federation": "x", "peer_queue_size": 7, "log_level": "debug"}
        )
    )
    env = {"GEOFED_BROKER_ID": "env", "GEOFED_PEER_QUEUE_SIZE": "9"}
    cfg = NodeConfig.load(
        {"broker_id": "flag", "strategy": None}, env=env, config_file=str(cfg_file)
    )
    assert cfg.broker_id == "flag"  # flag beats env beats file
    assert cfg.peer_queue_size == 9  # env beats file
    assert cfg.log_level == "debug"  # file beats default
    assert cfg.strategy == "event-geofence"  # default
    assert cfg.client_listen == "0.0.0.0:7400"


def test_flags_parse_into_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEOFED_CONFIG", raising=False)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            "--broker-id",
            "us",
            "--federation",
            "f",
            "--batch-max-delay-ms",
            "0.5",
            "--peer-queue-size",
            "3",
        ]
    )
    cfg = from_args(args)
    assert (cfg.broker_id, cfg.batch_max_delay_ms, cfg.peer_queue_size) == ("us", 0.5, 3)


@pytest.mark.parametrize(
    ("overrides", "env", "field"),
    [
        ({"broker_id": ""}, {}, "broker_id"),
        ({"federation": ""}, {}, "federation"),
        ({"strategy": "gossip"}, {}, "strategy"),
        ({"client_listen": "nowhere"}, {}, "client_listen"),
        ({"peer_listen": "127.0.0.1:99999"}, {}, "peer_listen"),
        ({"log_level": "loud"}, {}, "log_level"),
        ({"peer_queue_size": 0}, {}, "peer_queue_size"),
        ({"batch_max_delay_ms": -1.0}, {}, "batch_max_delay_ms"),
        ({"reconnect_initial_s": 2.0, "reconnect_max_s": 1.0}, {}, "reconnect_max_s"),
        ({"peer_heartbeat_s": 0.0}, {}, "peer_heartbeat_s"),
        ({"peer_timeout_s": -1.0}, {}, "peer_timeout_s"),
        ({"peer_heartbeat_s": 1.0, "peer_timeout_s": 1.5}, {}, "peer_timeout_s"),
        ({}, {"GEOFED_MAX_PAYLOAD_BYTES": "lots"}, "max_payload_bytes"),
        ({"history": "maybe"}, {}, "history"),
        ({"history_retention_s": -1.0}, {}, "history_retention_s"),
        ({"history_max_bytes": 0}, {}, "history_max_bytes"),
        ({"history_max_rows": 0}, {}, "history_max_rows"),
        ({"history_max_answer_bytes": 0}, {}, "history_max_answer_bytes"),
        ({"history_timeout_s": 0.0}, {}, "history_timeout_s"),
        ({"subscriber_batch_max": 0}, {}, "subscriber_batch_max"),
        ({}, {"GEOFED_STORE_CACHE_KIB": "0"}, "store_cache_kib"),
        ({"subscriber_batch_delay_ms": -1.0}, {}, "subscriber_batch_delay_ms"),
        ({}, {"GEOFED_SUBSCRIBER_BACKPRESSURE_MS": "-5"}, "subscriber_backpressure_ms"),
        ({"strategy_table": "{"}, {}, "strategy_table"),
        ({"strategy_table": '["a/#"]'}, {}, "strategy_table"),
        (
            {"strategy_table": '{"a/#/b": "event-geofence"}'},
            {},
            "strategy_table.entries[0].topic_filter",
        ),
        ({"strategy_table": '{"a/#": "gossip"}'}, {}, "strategy_table.entries[0].strategy"),
        ({"filter_scheme": "lps"}, {}, "filter_scheme"),
        ({"adaptive": "yes"}, {}, "adaptive"),
        ({"adaptive_config": "{"}, {}, "adaptive_config"),
        ({"adaptive_config": "[1]"}, {}, "adaptive_config"),
        ({"adaptive_config": '{"window": 1}'}, {}, "adaptive_config.window"),
        ({}, {"GEOFED_ADAPTIVE_CONFIG": '{"window_s": 0}'}, "adaptive_config.window_s"),
        ({"adaptive_config": '{"hysteresis": 1.5}'}, {}, "adaptive_config.hysteresis"),
        ({"adaptive_config": '{"candidates": ["gossip"]}'}, {}, "adaptive_config.candidates"),
        ({"filter_scheme_rgrid_at": -1}, {}, "filter_scheme_rgrid_at"),
        ({"filter_scheme_rgrid_at": 10, "filter_scheme_grid_at": 10}, {}, "filter_scheme_grid_at"),
        ({"filter_scheme_audit_every": 0}, {}, "filter_scheme_audit_every"),
        ({"filter_scheme": "rgrid", "filter_scheme_rgrid_at": 5}, {}, "filter_scheme_rgrid_at"),
        ({"filter_scheme": "grid", "filter_scheme_grid_at": 5}, {}, "filter_scheme_grid_at"),
    ],
)
def test_bad_values_name_the_field(
    overrides: dict[str, object], env: dict[str, str], field: str
) -> None:
    with pytest.raises(InvalidInput) as err:
        NodeConfig.load({**BASE, **overrides}, env=env)
    assert err.value.field == field
    assert str(err.value).startswith(field)


def test_config_file_errors_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInput, match="config"):
        NodeConfig.load(BASE, env={}, config_file=str(bad))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"colour": "blue"}))
    with pytest.raises(InvalidInput) as err:
        NodeConfig.load(BASE, env={}, config_file=str(unknown))
    assert err.value.field == "colour"
    with pytest.raises(InvalidInput, match="cannot read"):
        NodeConfig.load(BASE, env={}, config_file=str(tmp_path / "missing.json"))


def test_peer_timeout_zero_turns_the_heartbeat_check_off() -> None:
    cfg = NodeConfig.load({**BASE, "peer_timeout_s": 0.0, "peer_heartbeat_s": 5.0}, env={})
    assert (cfg.peer_timeout_s, cfg.peer_heartbeat_s) == (0.0, 5.0)


def test_the_adaptive_controller_is_off_by_default_and_takes_the_routing_cores_settings() -> None:
    assert NodeConfig.load(BASE, env={}).adaptive == "off"
    config = NodeConfig.load(
        {
            **BASE,
            "adaptive": "on",
            "adaptive_config": '{"window_s": 2.5, "candidates": ["event-geofence"]}',
        },
        env={},
    )
    settings = config.adaptive_settings()
    assert (settings.window_s, settings.candidates) == (2.5, ("event-geofence",))
    assert settings.hysteresis == AdaptiveConfig().hysteresis  # left out: the default


def test_the_strategy_table_starts_from_the_default_and_its_entries() -> None:
    config = NodeConfig.load(
        {**BASE, "strategy": "flooding-events", "strategy_table": '{"t/#": "event-geofence"}'}
    )
    table = config.initial_table()
    assert (table.epoch, table.default, table.entries) == (
        0,
        "flooding-events",
        (("t/#", "event-geofence"),),
    )
    assert table.strategy_for("t/x") == "event-geofence"
    assert table.strategy_for("u") == "flooding-events"
    admins = NodeConfig.load({**BASE, "strategy_admins": "ops, alice ,"})
    assert admins.strategy_admin_names() == {"ops", "alice"}


def test_brokers_whose_adaptive_controllers_differ_refuse_each_others_links() -> None:
    """The hello carries ``adaptive`` and its settings: the sequencer sums every broker's
    share, so a broker metering nothing (off) or by other settings is refused."""
    on = '{"window_s": 2.5}'
    eu = unstarted_node("eu", adaptive="on", adaptive_config=on)
    assert (
        eu.check_hello(unstarted_node("us", adaptive="on", adaptive_config=on).hello().hello) == ""
    )
    for other in (
        unstarted_node("us"),
        unstarted_node("us", adaptive="on"),
        unstarted_node("us", adaptive="on", adaptive_config='{"window_s": 5}'),
    ):
        why = eu.check_hello(other.hello().hello)
        assert why.startswith("adaptive mismatch: broker us runs adaptive"), why
        assert "broker eu runs 'on {" in why and '"window_s": 2.5' in why
    off = unstarted_node("eu")
    older = unstarted_node("us").hello().hello
    older.ClearField("adaptive")  # a sender from before the field: off
    assert off.check_hello(older) == ""
    assert eu.check_hello(older).startswith("adaptive mismatch")
