"""Command-line argument forms shared by the subcommands (errors name the option)."""

from __future__ import annotations

from pathlib import Path

from geofed.routing import Geofence, InvalidInput, LatLon, Roaming, parse_geofence
from geofed.wire import geofence_from_text, location_from_text

GEOFENCE_HELP = "WKT, GeoJSON, circle:LAT,LON,RADIUS_M, world, or @FILE holding one of them"
LOCATION_HELP = "LAT,LON in degrees"
ROAMING_HELP = (
    "or a roaming geofence around the subscriber, moving with it:"
    " roam:circle:RADIUS_M, roam:polygon:'E N, E N, ...' (metres east, north)"
)


def geofence_arg(text: str, field: str = "geofence") -> Geofence | None:
    """A geofence option (see `GEOFENCE_HELP`); ``world`` is None, the whole world."""
    value = geofence_from_text(_read(text, field), field)
    # A roaming geofence goes back as text, which parse_geofence refuses here by name.
    return parse_geofence(value.text if isinstance(value, Roaming) else value, field)


def subscription_geofence_arg(text: str, field: str = "geofence") -> Geofence | Roaming | None:
    """A subscription geofence option: as `geofence_arg`, or roaming (`ROAMING_HELP`)."""
    value = geofence_from_text(_read(text, field), field)
    return value if isinstance(value, Roaming) else parse_geofence(value, field)


def _read(text: str, field: str) -> str:
    """The option's text, or the content of the file ``@FILE`` names."""
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise InvalidInput(field, f"cannot read {path}: {reason}") from None
    return text


def location_arg(text: str, field: str = "location") -> LatLon:
    """A location option: ``LAT,LON`` in degrees."""
    return location_from_text(text, field)
