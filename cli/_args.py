"""Command-line argument forms shared by the subcommands (errors name the option)."""

from __future__ import annotations

from pathlib import Path

from geofed.routing import Geofence, InvalidInput, LatLon, parse_geofence
from geofed.wire import geofence_from_text, location_from_text

GEOFENCE_HELP = "WKT, GeoJSON, circle:LAT,LON,RADIUS_M, world, or @FILE holding one of them"
LOCATION_HELP = "LAT,LON in degrees"


def geofence_arg(text: str, field: str = "geofence") -> Geofence | None:
    """A geofence option (see `GEOFENCE_HELP`); ``world`` is None, the whole world."""
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise InvalidInput(field, f"cannot read {path}: {reason}") from None
    return parse_geofence(geofence_from_text(text, field), field)


def location_arg(text: str, field: str = "location") -> LatLon:
    """A location option: ``LAT,LON`` in degrees."""
    return location_from_text(text, field)
