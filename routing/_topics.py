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
