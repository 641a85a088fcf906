"""Optional dependencies: a clear message, not a traceback, when an extra is not installed."""

from __future__ import annotations

import importlib.util

from geofed.routing import GeofedError


class MissingExtra(GeofedError):
    """A feature needs an optional dependency group (``pip install 'geofed[extra]'``)."""

    def __init__(self, extra: str, module: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs the {extra!r} extra (module {module} is not installed): "
            f"pip install 'geofed[{extra}]'"
        )
        self.extra = extra
        self.module = module


def require(extra: str, feature: str, *modules: str) -> None:
    """Raise `MissingExtra` unless every module of `modules` can be imported."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(extra, module, feature)
