"""MQTT 3.1.1 / 5 topic names and topic filters.

Levels are separated by ``/``; in a filter ``+`` matches exactly one level and
``#`` (only as the last level) matches the parent level and everything below.
Topics starting with ``$`` are not matched by a filter whose first level is a
wildcard.
"""

from __future__ import annotations

from ._errors import InvalidInput

MAX_TOPIC_BYTES = 65_535


def validate_topic(topic: object, field: str = "topic") -> str:
    """Check a topic name (what events are published to).

    Raises:
        InvalidInput: naming `field` if empty, too long, or holding a wildcard.
    """
    text = _check_text(topic, field)
    if "+" in text or "#" in text:
        raise InvalidInput(field, "a topic name must not contain wildcards '+' or '#'")
    return text


def validate_filter(topic_filter: object, field: str = "topic_filter") -> str:
    """Check a topic filter (what subscriptions ask for).

    Raises:
        InvalidInput: naming `field` if empty, too long, or misusing a wildcard.
    """
    text = _check_text(topic_filter, field)
    levels = text.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise InvalidInput(field, "'#' must be a whole level and the last one")
        if "+" in level and level != "+":
            raise InvalidInput(field, "'+' must be a whole level")
    return text


def _check_text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(field, f"must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidInput(field, "must not be empty")
    if "\x00" in value:
        raise InvalidInput(field, "must not contain NUL")
    if len(value.encode("utf-8")) > MAX_TOPIC_BYTES:
        raise InvalidInput(field, f"longer than {MAX_TOPIC_BYTES} bytes")
    return value


def topic_matches(topic_filter: str, topic: str) -> bool:
    """The ContentCheck for one filter and one topic (both already validated)."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


# A final '#' also matches its parent level, except where that parent would be
# the empty topic (no level, or one empty level), which is no topic at all:
# there "#" matches what "+/#" does, and "/#" what "/+/#" does.
_ROOT_HASH = {"#": "+/#", "/#": "/+/#"}


def _levels(topic_filter: str) -> list[str]:
    return _ROOT_HASH.get(topic_filter, topic_filter).split("/")


def _matches_dollar(levels: list[str]) -> bool:
    """Whether a filter can match a topic whose first level starts with ``$``."""
    return levels[0] not in ("+", "#")


def filters_overlap(first: str, second: str) -> bool:
    """Whether some topic matches both filters (both already validated).

    Level by level: a ``#`` in either accepts whatever the other asks for
    beyond it (``#`` also matches the parent level), ``+`` accepts any one
    level, literals must be equal. A filter that starts with a wildcard
    matches no ``$`` topic, so it meets no filter whose first level is a
    literal starting with ``$``.
    """
    a, b = _levels(first), _levels(second)
    for p, q in ((a, b), (b, a)):
        if not _matches_dollar(p) and q[0].startswith("$"):
            return False
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x == "#" or y == "#":
            return True
        if x is None or y is None:
            return False
        if x != "+" and y != "+" and x != y:
            return False
    return True


def filter_covers(outer: str, inner: str) -> bool:
    """Whether every topic `inner` matches is matched by `outer` (both validated)."""
    o, n = _levels(outer), _levels(inner)
    if _matches_dollar(n) and n[0].startswith("$") and not _matches_dollar(o):
        return False
    for i, level in enumerate(n):
        if i < len(o) and o[i] == "#":
            return True
        if i >= len(o) or level == "#":
            return False
        if level == "+" and o[i] != "+":
            return False
        if level != "+" and o[i] not in ("+", level):
            return False
    return len(o) == len(n) or (len(o) == len(n) + 1 and o[-1] == "#")


_SPECIFICITY = {"#": 0, "+": 2}  # a literal level ranks 3, the end of a filter 1


def filter_specificity(topic_filter: str) -> tuple[int, ...]:
    """A key ordering the filters that match one topic, most specific last.

    Level by level from the first: a literal level beats ``+``, ``+`` beats
    the end of the filter, the end beats ``#`` (``a`` beats ``a/#`` for the
    topic ``a``). Two different filters matching the same topic never have
    the same key: where their keys agree, so do their levels (a literal must
    equal the topic's level).
    """
    return (*(_SPECIFICITY.get(level, 3) for level in topic_filter.split("/")), 1)
