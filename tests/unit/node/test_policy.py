"""The authorization policy: topic grants with wildcards and substitutions, areas, the file.

Coverage of a subscribe filter by a granted pattern is held against a brute
force over every topic of a small alphabet, matched by the routing core's
independent reference matcher (`reference_topic_match`).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from geofed.node import Policy, PolicyFile, covered
from geofed.routing import InvalidInput, PermissionDenied, latlon, reference_topic_match

POLICY = """
[everyone]
publish = ["clients/%c/#"]
subscribe = ["clients/%c/#", "news/+/headlines", "users/%u/inbox"]

[identities.alice]
publish = ["sensors/%u/+", "$SYS/alice/#"]
subscribe = ["alerts/#"]
area = "POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))"

[identities.carol]
subscribe = ["#"]

[groups.operators]
members = ["bob"]
publish = ["ops/#"]
subscribe = ["ops/+/status"]
area = { circle = { lat = 40.71, lon = -74.0, radius_m = 50000 } }

[groups.auditors]
subscribe = ["$SYS/#"]
"""

PARIS = latlon(48.85, 2.35)
NEW_YORK = latlon(40.71, -74.0)
TOKYO = latlon(35.68, 139.77)


@pytest.fixture
def policy_path(tmp_path: Path) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    return path


@pytest.fixture
def policy(policy_path: Path) -> Policy:
    return Policy.load(policy_path)


def denied(check: object, *args: object) -> PermissionDenied:
    with pytest.raises(PermissionDenied) as info:
        check(*args)  # type: ignore[operator]
    return info.value


# --------------------------------------------------------------------------
# Coverage of a filter by a pattern


@pytest.mark.parametrize(
    ("pattern", "topic_filter", "expected"),
    [
        ("a/#", "a/#", True),
        ("a/#", "a/+", True),
        ("a/#", "a", True),
        ("a/b/#", "a/#", False),  # a/# also matches a/c and a itself
        ("a/+", "a/#", False),  # a/# also matches a and a/b/c
        ("a/+", "a/+", True),
        ("a/+", "a/b", True),
        ("a/b", "a/+", False),
        ("+/b", "a/b", True),
        ("#", "#", True),
        ("#", "$SYS/#", False),  # a wildcard first level never matches a $ topic
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/#", True),
        ("$SYS/#", "#", False),
        ("+/#", "a/#", True),
        ("+/#", "a", True),
        ("a/+/#", "a/#", False),  # a/# matches a, a/+/# does not
        ("a/+/#", "a/b/#", True),
        ("+/#", "#", True),  # '#' matches no empty topic
        ("+/+/#", "#", False),
        ("+/+/#", "/#", True),  # '/#' matches '/', '/a', ... but no empty topic
        ("+/+/#", "a/#", False),
    ],
)
def test_coverage_examples(pattern: str, topic_filter: str, expected: bool) -> None:
    assert covered(pattern, topic_filter) is expected


LITERALS = ["a", "b", "", "$s"]
UNIVERSE = [
    "/".join(levels)
    for n in range(1, 5)
    for levels in itertools.product([*LITERALS, "z"], repeat=n)
    if levels != ("",)
]
"""Every topic of up to 4 levels over the literals plus one no filter names."""


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from([*LITERALS, "+"]), max_size=3))
    if draw(st.booleans()) or not levels or levels == [""]:
        levels.append("#")
    return "/".join(levels)


@settings(max_examples=1000, deadline=None)
@given(filters(), filters())
@example("a/b/#", "a/#")
@example("a/+", "a/#")
@example("#", "$s/#")
@example("+/#", "/#")
@example("a/+/#", "a/#")  # found by this test: the pattern's '+' took the filter's '#'
@example("+/#", "#")  # found by this test: no topic is empty
@example("+/+/#", "/#")  # found by the exhaustive test below
def test_coverage_agrees_with_a_brute_force_over_topics(pattern: str, topic_filter: str) -> None:
    # Up to 3 levels plus '#': a topic one level deeper than any pattern tells them apart.
    expected = all(
        reference_topic_match(pattern, t)
        for t in UNIVERSE
        if reference_topic_match(topic_filter, t)
    )
    assert covered(pattern, topic_filter) is expected


def test_coverage_agrees_with_the_brute_force_for_every_small_pair() -> None:
    # Every filter of up to 3 levels over the alphabet, with and without a final '#'.
    every = {
        "/".join([*levels, "#"][: len(levels) + hash_])
        for n in range(4)
        for levels in itertools.product([*LITERALS, "+"], repeat=n)
        for hash_ in (0, 1)
    } - {""}
    matched = {f: frozenset(t for t in UNIVERSE if reference_topic_match(f, t)) for f in every}
    wrong = [(p, f) for p in every for f in every if covered(p, f) != (matched[f] <= matched[p])]
    assert len(every) == 310 and wrong == []


# --------------------------------------------------------------------------
# Publish and subscribe


def test_publish_needs_a_matching_pattern(policy: Policy) -> None:
    policy.check_publish("alice", [], "alice-phone", "sensors/alice/temp")
    policy.check_publish("alice", [], "alice-phone", "clients/alice-phone/x/y")  # everyone
    policy.check_publish("alice", [], "c1", "$SYS/alice/load")  # named explicitly
    error = denied(policy.check_publish, "alice", [], "c1", "sensors/bob/temp")
    assert error.rule == "publish"
    assert "'alice'" in error.detail and "'sensors/bob/temp'" in error.detail
    assert str(policy_source := policy.source) in error.detail and "policy.toml" in policy_source
    denied(policy.check_publish, "alice", [], "c1", "sensors/alice/temp/deeper")  # + is one level
    denied(policy.check_publish, "alice", [], "c1", "clients/c2/x")  # another client's tree


def test_a_history_delete_filter_needs_a_publish_pattern_covering_it(policy: Policy) -> None:
    """check_publish given a filter (a history delete): one pattern must cover it."""
    policy.check_publish("alice", [], "c1", "sensors/alice/+")  # sensors/%u/+
    policy.check_publish("alice", [], "c1", "clients/c1/#")  # clients/%c/#
    policy.check_publish("alice", [], "c1", "clients/c1/+/x")
    for topic_filter in ("sensors/+/+", "sensors/alice/#", "sensors/#", "#", "clients/+/#"):
        assert denied(policy.check_publish, "alice", [], "c1", topic_filter).rule == "publish"


def test_default_deny_for_identities_the_policy_does_not_name(policy: Policy) -> None:
    policy.check_publish("mallory", [], "m1", "clients/m1/hello")  # only what everyone has
    assert denied(policy.check_publish, "mallory", [], "m1", "news/fr/headlines").rule == "publish"
    assert denied(policy.check_subscribe, "mallory", [], "m1", "#").rule == "subscribe"
    empty = Policy.from_mapping({})
    denied(empty.check_publish, "alice", ["operators"], "c", "a")
    denied(empty.check_subscribe, "alice", ["operators"], "c", "a")


def test_dollar_topics_are_reserved_unless_a_pattern_names_them(policy: Policy) -> None:
    policy.check_subscribe("carol", [], "c", "news/#")  # carol has '#'
    denied(policy.check_subscribe, "carol", [], "c", "$SYS/#")
    denied(policy.check_subscribe, "carol", [], "c", "$SYS/broker/load")
    policy.check_subscribe("carol", ["auditors"], "c", "$SYS/broker/load")
    policy.check_subscribe("carol", ["auditors"], "c", "$SYS/#")


def test_a_subscription_must_be_covered_by_one_pattern(policy: Policy) -> None:
    policy.check_subscribe("alice", [], "c", "alerts/#")
    policy.check_subscribe("alice", [], "c", "alerts/+/fire")
    policy.check_subscribe("alice", [], "c", "news/+/headlines")
    error = denied(policy.check_subscribe, "alice", [], "c", "news/#")
    assert error.rule == "subscribe" and "'news/#'" in error.detail
    denied(policy.check_subscribe, "bob", [], "c", "ops/#")  # ops/+/status does not cover it
    policy.check_subscribe("bob", [], "c", "ops/+/status")


def test_substitutions_take_the_client_id_and_the_identity(policy: Policy) -> None:
    policy.check_subscribe("dave", [], "d1", "users/dave/inbox")
    policy.check_subscribe("dave", [], "d1", "clients/d1/#")
    denied(policy.check_subscribe, "dave", [], "d1", "users/erin/inbox")
    denied(policy.check_subscribe, "dave", [], "d1", "clients/d2/#")


@pytest.mark.parametrize("client_id", ["a/b", "+", "#", "x+y", "", "$SYS"])
def test_a_value_that_would_widen_a_pattern_grants_nothing(client_id: str) -> None:
    policy = Policy.from_mapping({"everyone": {"publish": ["%c/#"], "subscribe": ["%c/#"]}})
    # With client id "+" the pattern would read "+/#", granting every client's tree.
    denied(policy.check_publish, "u", [], client_id, "other/x")
    denied(policy.check_subscribe, "u", [], client_id, f"{client_id}/#" if client_id else "x/#")
    denied(policy.check_publish, "u", [], client_id, "$SYS/x")
    policy.check_publish("u", [], "ok", "ok/x")


def test_groups_come_from_the_token_and_from_the_file(policy: Policy) -> None:
    policy.check_publish("bob", [], "b1", "ops/deploy")  # a member in the file
    policy.check_publish("erin", ["operators"], "e1", "ops/deploy")  # a token's group
    denied(policy.check_publish, "erin", ["unknown-group"], "e1", "ops/deploy")
    assert [g.where for g in policy.grants("bob", ["auditors"])] == [
        "everyone",
        "groups.operators",
        "groups.auditors",
    ]


# --------------------------------------------------------------------------
# Areas


def test_a_location_must_lie_in_one_of_the_areas_that_apply(policy: Policy) -> None:
    policy.check_location("alice", [], PARIS)
    error = denied(policy.check_location, "alice", [], TOKYO)
    assert error.rule == "location" and "identities.alice" in error.detail
    assert "(35.68, 139.77)" in error.detail
    policy.check_location("bob", [], NEW_YORK)  # the group's circle
    denied(policy.check_location, "bob", [], PARIS)
    # Areas add up: alice as an operator may be in Europe or around New York.
    policy.check_location("alice", ["operators"], NEW_YORK)
    policy.check_location("alice", ["operators"], PARIS)
    error = denied(policy.check_location, "alice", ["operators"], TOKYO)
    assert "identities.alice, groups.operators" in error.detail
    # No entry that applies gives an area: anywhere.
    policy.check_location("carol", [], TOKYO)
    policy.check_location("mallory", [], TOKYO)


def test_an_area_boundary_is_inside() -> None:
    policy = Policy.from_mapping(
        {"identities": {"a": {"area": "POLYGON((0 0, 10 0, 10 10, 0 10, 0 0))"}}}
    )
    policy.check_location("a", [], latlon(10, 5))
    denied(policy.check_location, "a", [], latlon(10.001, 5))


# --------------------------------------------------------------------------
# The file


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        ("[identities.alice\npublish = []", "", "not TOML"),
        ("[identities.alice]\npublish = 'a/#'", "identities.alice.publish", "list of strings"),
        ("[identities.alice]\npublish = ['a/#', 'a/#/b']", "identities.alice.publish[1]", "'#'"),
        ("[identities.alice]\nsubscribe = ['a+']", "identities.alice.subscribe[0]", "'+'"),
        ("[identities.alice]\npublsh = ['a']", "identities.alice.publsh", "unknown key"),
        ("[identities.alice]\nmembers = ['x']", "identities.alice.members", "unknown key"),
        ("[users.alice]\npublish = []", "users", "unknown section"),
        ("identities = 3", "identities", "must be a table"),
        ("[groups.ops]\nmembers = ['']", "groups.ops.members[0]", "empty"),
        ("[groups.ops]\narea = 'POLYGON((0 0, 1 1))'", "groups.ops.area", ""),
        ("[everyone]\narea = { circle = { lat = 0, lon = 0 } }", "everyone.area.circle", ""),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_and_key(
    tmp_path: Path, text: str, field: str, reason: str
) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(InvalidInput) as info:
        Policy.load(path)
    expected = f"policy {path}: {field}" if field else f"policy {path}"
    assert info.value.field.startswith(expected) and reason in info.value.reason


def test_a_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[everyone]\npublish = ['a']\nsubscribe ['b']\n")
    with pytest.raises(InvalidInput, match=r"line 3") as info:
        Policy.load(path)
    assert info.value.field == f"policy {path}"
    with pytest.raises(InvalidInput, match="cannot read"):
        Policy.load(tmp_path / "missing.toml")


def _replace(path: Path, text: str) -> None:
    """Write a new version of the file and rename it over the old one (a new inode)."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_the_policy_file_is_reloaded_when_it_changes(policy_path: Path) -> None:
    live = PolicyFile(policy_path, check_interval_s=0)
    denied(live.check_publish, "mallory", [], "m", "chat/x")
    _replace(policy_path, POLICY + '\n[identities.mallory]\npublish = ["chat/#"]\n')
    live.check_publish("mallory", [], "m", "chat/x")
    assert live.loads == 2 and live.error is None


def test_a_broken_policy_file_keeps_the_previous_policy(
    policy_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = PolicyFile(policy_path, check_interval_s=0)
    _replace(policy_path, "[identities.alice]\npublish = ['a/#/b']\n")
    with caplog.at_level(logging.WARNING, "geofed.node.policy"):
        live.check_publish("alice", [], "c", "sensors/alice/temp")  # the old grants hold
        live.check_publish("alice", [], "c", "sensors/alice/temp")
    assert live.error is not None and "identities.alice.publish[0]" in live.error
    assert caplog.text.count("not reloaded") == 1  # once per change, not per check
    policy_path.unlink()
    live.check_location("alice", [], PARIS)  # a vanished file keeps the policy too
    _replace(policy_path, '[identities.alice]\npublish = ["a/#"]\n')
    live.check_publish("alice", [], "c", "a/b")
    denied(live.check_publish, "alice", [], "c", "sensors/alice/temp")
    assert live.error is None and live.loads == 2


def test_the_file_is_looked_at_at_most_once_per_interval(policy_path: Path) -> None:
    now = [100.0]
    live = PolicyFile(policy_path, check_interval_s=5.0, clock=lambda: now[0])
    _replace(policy_path, '[everyone]\npublish = ["#"]\n')
    denied(live.check_publish, "x", [], "c", "t")  # within the interval: the old policy
    now[0] += 5.0
    live.check_publish("x", [], "c", "t")


def test_a_policy_file_that_does_not_load_at_start_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[x]")
    with pytest.raises(InvalidInput, match="unknown section"):
        PolicyFile(path)


def test_the_example_in_the_security_guide_loads_and_means_what_it_says(tmp_path: Path) -> None:
    guide = Path(__file__).resolve().parents[3] / "docs" / "security.md"
    (block,) = re.findall(r"```toml\n(.*?)```", guide.read_text(), re.S)
    path = tmp_path / "policy.toml"
    path.write_text(block)
    policy = Policy.load(path)
    policy.check_publish("alice", [], "c1", "sensors/alice/temp")
    policy.check_subscribe("bob", [], "b1", "ops/web/status")
    denied(policy.check_subscribe, "carol", [], "c1", "$SYS/#")
    policy.check_subscribe("carol", ["auditors"], "c1", "$SYS/#")
    denied(policy.check_location, "alice", [], TOKYO)
