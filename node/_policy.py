"""Authorization: which topics an authenticated client may publish and subscribe to, and where.

Why: authentication says who a client is; without a policy any client could
still publish to any topic (``$SYS/...`` included), read every topic and
claim any location (issue #12). The policy is a TOML file
(`docs/security.md` has the format and examples)::

    [everyone]                        # every authenticated identity
    publish = ["clients/%c/#"]        # %c: the client id, %u: the identity
    subscribe = ["clients/%c/#", "news/#"]

    [identities.alice]
    publish = ["sensors/%u/+"]
    area = "POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))"

    [groups.operators]
    members = ["bob"]                 # besides those a token's groups claim names
    subscribe = ["#", "$SYS/#"]

Rules, once a policy is configured:

* **default deny**: a publish or subscribe needs a granting pattern from the
  identity's entry, one of its groups' or ``[everyone]``; grants add up;
* patterns are MQTT topic filters (``+``, ``#``) matched by the routing core's
  `topic_matches`; ``%c`` and ``%u`` are replaced by the client id and the
  identity. A value that is empty, holds ``/``, ``+`` or ``#``, or would
  make the pattern start with ``$`` would widen it, so a rule needing it
  grants nothing;
* ``$`` topics are reserved: a pattern starting with a wildcard never matches
  a topic starting with ``$`` (the MQTT rule), so only a pattern that names
  the ``$`` level (``$SYS/#``) grants them;
* a subscribe filter must be **covered** by one pattern: every topic the
  filter can match must match the pattern (``a/#`` is not covered by
  ``a/b/#``, ``a/+`` is covered by ``a/#``);
* **area**: an entry may give a geofence (any form `parse_geofence` takes);
  a client's claimed location must lie in one of the areas of the entries
  that apply to it. If none of them gives an area, any location is allowed.

`PolicyFile` follows the file: a changed file is loaded again, and a file
that does not load is logged and the previous policy kept.
"""

from __future__ import annotations

import logging
import time
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geofed.routing import (
    Geofence,
    InvalidInput,
    LatLon,
    PermissionDenied,
    covers,
    parse_geofence,
    topic_matches,
    validate_filter,
    validate_id,
)

from ._watch import WatchedFile

log = logging.getLogger("geofed.node.policy")

_SECTIONS = ("everyone", "identities", "groups")
_ENTRY_KEYS = {"publish", "subscribe", "area"}
_GROUP_KEYS = _ENTRY_KEYS | {"members"}
_UNSAFE = ("/", "+", "#")
AREA_MAX_VERTICES = 1_000_000
"""Areas are operator configuration, as detailed as federation areas may be."""


@dataclass(frozen=True)
class Grant:
    """What one policy entry allows."""

    where: str
    """The entry's key in the file (``identities.alice``), for messages."""
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    area: Geofence | None = None
    """The locations its clients may claim; None: this entry does not restrict them."""


def covered(pattern: str, topic_filter: str) -> bool:
    """Whether every topic `topic_filter` matches is matched by `pattern` (both valid filters).

    The filter is matched as if it were a topic, wildcard levels as literal
    levels: a pattern level ``+`` or ``#`` then takes a filter's ``+`` just as
    it takes any one level. One case differs: a filter's ``#`` stands for any
    number of levels (none included), which only a pattern's ``#`` at the same
    level or above covers (``a/+/#`` does not cover ``a/#``, which matches ``a``).
    Unless that parent would be the empty topic, which does not exist: ``+/#``
    covers ``#`` and ``+/+/#`` covers ``/#``.
    """
    if not topic_matches(pattern, topic_filter):
        return False
    if not topic_filter.endswith("#"):
        return True
    if not pattern.endswith("#"):
        return False
    deeper = pattern.count("/") - topic_filter.count("/")
    # topic_matches let a pattern '+' take the filter's '#' only if it is the last but one level.
    return deeper <= 0 or topic_filter.removesuffix("#").removesuffix("/") == ""


def _substitute(pattern: str, identity: str, client_id: str) -> str | None:
    """The pattern for this client, or None if a substituted value would widen it.

    Widening: an empty value, one holding ``/``, ``+`` or ``#``, or one that
    makes the pattern start with ``$`` (client ``$SYS`` under ``%c/#``).
    """
    out = pattern
    for token, value in (("%c", client_id), ("%u", identity)):
        if token in out:
            if not value or any(c in value for c in _UNSAFE):
                return None
            out = out.replace(token, value)
    if out.startswith("$") and not pattern.startswith("$"):
        return None
    return out


class Policy:
    """A loaded policy: the grants per identity and group, checked per request."""

    def __init__(
        self,
        everyone: Grant | None,
        identities: Mapping[str, Grant],
        groups: Mapping[str, Grant],
        members: Mapping[str, Collection[str]],
        source: str = "policy",
    ) -> None:
        """Build from parsed entries (`Policy.load` and `Policy.from_mapping` do that).

        Args:
            everyone: the grant every authenticated identity has, if any.
            identities: identity -> its own grant.
            groups: group name -> its grant.
            members: group name -> identities the file lists as members.
            source: names the policy in denials (``policy /etc/geofed/policy.toml``).
        """
        self.everyone = everyone
        self.identities = dict(identities)
        self.groups = dict(groups)
        self.source = source
        self._member_of: dict[str, set[str]] = {}
        for group, names in members.items():
            for name in names:
                self._member_of.setdefault(name, set()).add(group)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """Read a policy file (TOML).

        Raises:
            InvalidInput: naming the file and the key (or the line, for TOML
                syntax) that is wrong.
        """
        p = Path(path)
        source = f"policy {p}"
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InvalidInput(source, f"cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise InvalidInput(source, f"not UTF-8: {exc.reason}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidInput(source, f"not TOML: {exc}") from None  # says line and column
        return cls.from_mapping(data, source=source)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "policy") -> Policy:
        """Build from parsed TOML (or an equal dict).

        Raises:
            InvalidInput: naming `source` and the key that is wrong.
        """
        for key in data:
            if key not in _SECTIONS:
                raise InvalidInput(
                    f"{source}: {key}", f"unknown section (expected {', '.join(_SECTIONS)})"
                )
        everyone = None
        if "everyone" in data:
            everyone = _grant(data["everyone"], "everyone", _ENTRY_KEYS, source)
        identities = {
            validate_id(name, f"{source}: identities.{name}"): _grant(
                entry, f"identities.{name}", _ENTRY_KEYS, source
            )
            for name, entry in _table(data.get("identities", {}), "identities", source).items()
        }
        groups: dict[str, Grant] = {}
        members: dict[str, list[str]] = {}
        for name, entry in _table(data.get("groups", {}), "groups", source).items():
            where = f"groups.{name}"
            groups[name] = _grant(entry, where, _GROUP_KEYS, source)
            members[name] = [
                validate_id(m, f"{source}: {where}.members[{i}]")
                for i, m in enumerate(
                    _strings(entry.get("members", []), f"{where}.members", source)
                )
            ]
        return cls(everyone, identities, groups, members, source)

    # ----------------------------------------------------------------------
    # Checks

    def grants(self, identity: str, groups: Iterable[str] = ()) -> list[Grant]:
        """The entries that apply to `identity` with `groups` (its token's), in file order."""
        mine = set(groups) | self._member_of.get(identity, set())
        out = [] if self.everyone is None else [self.everyone]
        if identity in self.identities:
            out.append(self.identities[identity])
        out.extend(grant for name, grant in self.groups.items() if name in mine)
        return out

    def check_publish(
        self, identity: str, groups: Iterable[str], client_id: str, topic: str
    ) -> None:
        """Allow a publish to `topic` (a valid topic name) or refuse it.

        `topic` may also be a topic filter (a history delete removes what was
        published under it): then one pattern must cover every topic it
        matches, as for a subscription. For a topic name that is plain matching.

        Raises:
            PermissionDenied: (rule ``publish``) no pattern granted to the identity matches.
        """
        for grant in self.grants(identity, groups):
            for pattern in grant.publish:
                mine = _substitute(pattern, identity, client_id)
                if mine is not None and covered(mine, topic):
                    return
        raise PermissionDenied(
            "publish", f"{self.source} grants {identity!r} no publish pattern matching {topic!r}"
        )

    def check_subscribe(
        self, identity: str, groups: Iterable[str], client_id: str, topic_filter: str
    ) -> None:
        """Allow a subscription to `topic_filter` (a valid filter) or refuse it.

        Raises:
            PermissionDenied: (rule ``subscribe``) no pattern granted to the identity covers
                every topic the filter can match.
        """
        for grant in self.grants(identity, groups):
            for pattern in grant.subscribe:
                mine = _substitute(pattern, identity, client_id)
                if mine is not None and covered(mine, topic_filter):
                    return
        raise PermissionDenied(
            "subscribe",
            f"{self.source} grants {identity!r} no subscribe pattern covering {topic_filter!r}",
        )

    def check_location(self, identity: str, groups: Iterable[str], location: LatLon) -> None:
        """Allow a client to claim `location`, or refuse it if outside all of its areas.

        Raises:
            PermissionDenied: (rule ``location``) naming the entries whose areas it is outside.
        """
        fenced = [g for g in self.grants(identity, groups) if g.area is not None]
        if not fenced or any(covers(g.area, location) for g in fenced):
            return
        raise PermissionDenied(
            "location",
            f"({location.lat:g}, {location.lon:g}) is outside the areas {identity!r} may claim"
            f" ({', '.join(g.where for g in fenced)} in {self.source})",
        )


def _table(value: Any, where: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(f"{source}: {where}", "must be a table")
    return value


def _strings(value: Any, where: str, source: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidInput(f"{source}: {where}", "must be a list of strings")
    return value


def _grant(entry: Any, where: str, keys: set[str], source: str) -> Grant:
    entry = _table(entry, where, source)
    for key in entry:
        if key not in keys:
            raise InvalidInput(
                f"{source}: {where}.{key}", f"unknown key (expected {', '.join(sorted(keys))})"
            )
    patterns: dict[str, tuple[str, ...]] = {}
    for kind in ("publish", "subscribe"):
        texts = _strings(entry.get(kind, []), f"{where}.{kind}", source)
        patterns[kind] = tuple(
            validate_filter(t, f"{source}: {where}.{kind}[{i}]") for i, t in enumerate(texts)
        )
    area = None
    if "area" in entry:
        area = parse_geofence(
            entry["area"],
            f"{source}: {where}.area",
            max_vertices=AREA_MAX_VERTICES,
            max_bytes=None,
        )
    return Grant(where, patterns["publish"], patterns["subscribe"], area)


class PolicyFile:
    """A policy that follows its file: loaded again when the file changes.

    A change is seen by the file's modification time, size or inode (write a
    new file and rename it over the old one, as editors and Kubernetes do). A
    file that no longer loads is logged once per change and the previous
    policy stays in force; `error` says why until a good file replaces it
    (`_watch.WatchedFile`, as for the token key).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Load the policy at `path`.

        Args:
            path: the TOML policy file.
            check_interval_s: look at the file at most this often (0: at every check).
            clock: monotonic seconds (tests may drive it).

        Raises:
            InvalidInput: the file does not load now (a broker should not start on it).
        """
        self._file = WatchedFile(
            path,
            Policy.load,
            "policy",
            check_interval_s=check_interval_s,
            clock=clock,
            logger=log,
        )
        self.path = self._file.path

    @property
    def error(self) -> str | None:
        """Why the file's current content is not in force (None: it is)."""
        return self._file.error

    @property
    def loads(self) -> int:
        """How many times a policy was loaded from the file."""
        return self._file.loads

    @property
    def policy(self) -> Policy:
        """The policy in force, after loading the file again if it changed."""
        return self._file.value

    def check_publish(
        self, identity: str, groups: Iterable[str], client_id: str, topic: str
    ) -> None:
        """`Policy.check_publish` with the policy in force."""
        self.policy.check_publish(identity, groups, client_id, topic)

    def check_subscribe(
        self, identity: str, groups: Iterable[str], client_id: str, topic_filter: str
    ) -> None:
        """`Policy.check_subscribe` with the policy in force."""
        self.policy.check_subscribe(identity, groups, client_id, topic_filter)

    def check_location(self, identity: str, groups: Iterable[str], location: LatLon) -> None:
        """`Policy.check_location` with the policy in force."""
        self.policy.check_location(identity, groups, location)
