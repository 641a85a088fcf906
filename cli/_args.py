"""Command-line argument forms shared by the subcommands (errors name the option)."""

from __future__ import annotations

from pathlib import Path

from geofed.routing import Geofence, InvalidInput, LatLon, latlon, parse_geofence

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
    if text.strip().lower() == "world":
        return None
    if text.startswith("circle:"):
        parts = text[len("circle:") :].split(",")
        try:
            lat, lon, radius = (float(v) for v in parts)
        except ValueError:
            raise InvalidInput(
                field, f"expected circle:LAT,LON,RADIUS_M (three numbers), got {text!r}"
            ) from None
        return parse_geofence({"circle": {"lat": lat, "lon": lon, "radius_m": radius}}, field)
    return parse_geofence(text, field)


def location_arg(text: str, field: str = "location") -> LatLon:
    """A location option: ``LAT,LON`` in degrees."""
    try:
        lat, lon = (float(v) for v in text.split(","))
    except ValueError:
        raise InvalidInput(field, f"expected LAT,LON (two numbers), got {text!r}") from None
    return latlon(lat, lon, field)
