"""The exception hierarchy shared by every geofed package.

One root (`GeofedError`) so callers can catch everything geofed raises; a few
subclasses carry the data a caller needs (which field, which limit). The node
maps them onto gRPC status codes in one place.
"""

from __future__ import annotations

from pathlib import Path


class GeofedError(Exception):
    """Root of every error geofed raises on purpose."""


class InvalidInput(GeofedError, ValueError):
    """Input rejected; `field` names what was wrong (e.g. ``event.geofence``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[type[InvalidInput], tuple[str, str]]:
        # Pickle by constructor arguments (multiprocessing, Spark workers).
        return (type(self), (self.field, self.reason))

    def within(self, prefix: str) -> InvalidInput:
        """The same error with its field qualified by `prefix` (``prefix.field``)."""
        return InvalidInput(f"{prefix}.{self.field}" if self.field else prefix, self.reason)


def read_input_file(path: str | Path, field: str) -> bytes:
    """The bytes of a file a setting or option names (a certificate, a key, a policy).

    Raises:
        InvalidInput: naming `field` and the file when it cannot be read.
    """
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(field, f"cannot read {path}: {exc.strerror}") from None


class TooLarge(GeofedError):
    """A payload, batch or geometry exceeds a configured limit."""

    def __init__(self, field: str, size: int, limit: int) -> None:
        super().__init__(f"{field}: {size} exceeds the limit of {limit}")
        self.field = field
        self.size = size
        self.limit = limit

    def __reduce__(self) -> tuple[type[TooLarge], tuple[str, int, int]]:
        return (type(self), (self.field, self.size, self.limit))


class NotFound(GeofedError):
    """A referenced subscription, client or broker does not exist."""

    def __init__(self, what: str, key: str) -> None:
        super().__init__(f"{what} {key!r} not found")
        self.what = what
        self.key = key

    def __reduce__(self) -> tuple[type[NotFound], tuple[str, str]]:
        return (type(self), (self.what, self.key))


class FederationMismatch(GeofedError):
    """A peer runs another strategy or another federation file."""


class WrongBroker(GeofedError):
    """This broker is not responsible for a location; `broker_id` is."""

    def __init__(self, field: str, broker_id: str, endpoint: str = "") -> None:
        super().__init__(f"{field}: location belongs to broker {broker_id!r}")
        self.field = field
        self.broker_id = broker_id
        self.endpoint = endpoint

    def __reduce__(self) -> tuple[type[WrongBroker], tuple[str, str, str]]:
        return (type(self), (self.field, self.broker_id, self.endpoint))


class PermissionDenied(GeofedError):
    """An authenticated caller is not allowed this; `rule` is the kind of rule that said no.

    `rule` is one of `PERMISSION_RULES`: ``publish`` or ``subscribe`` (no
    granted topic pattern covers the topic or filter), ``location`` (a claimed
    location outside the identity's area) or ``identity`` (the authenticated
    identity does not back the id it claims: a peer's broker id, a client id) or
    ``strategy`` (not in ``strategy_admins``, so it may not change the strategy table).
    """

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"{rule} denied: {detail}")
        self.rule = rule
        self.detail = detail

    def __reduce__(self) -> tuple[type[PermissionDenied], tuple[str, str]]:
        return (type(self), (self.rule, self.detail))


PERMISSION_RULES = ("publish", "subscribe", "location", "identity", "strategy")
"""The kinds of rule a `PermissionDenied` names (its ``rule``)."""


class Unauthenticated(GeofedError):
    """No valid credentials: no client certificate or token, or one that failed verification."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"unauthenticated: {reason}")
        self.reason = reason

    def __reduce__(self) -> tuple[type[Unauthenticated], tuple[str]]:
        return (type(self), (self.reason,))


class StorageFailed(GeofedError):
    """The broker could not make a request durable (its store failed), so it refused it."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"storage failed: {reason}")
        self.reason = reason

    def __reduce__(self) -> tuple[type[StorageFailed], tuple[str]]:
        return (type(self), (self.reason,))
