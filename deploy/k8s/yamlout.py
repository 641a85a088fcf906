"""Block-style YAML for Kubernetes manifests, without PyYAML.

`dump_yaml` writes JSON-like data (mappings in their order, lists, strings,
numbers, booleans, None) so that every YAML 1.1 or 1.2 reader, kubectl's
included, reads back exactly that data: a string is written plain only when
no reader could take it for anything else, and double-quoted otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Plain scalars are limited to what no YAML 1.1 or 1.2 reader takes for
# anything but a string; everything else is double-quoted.
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./@=+-]*(:[A-Za-z0-9_./@=+-]+)*")
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "nan", "inf"}


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"cannot write {value!r} as YAML for Kubernetes")
        # YAML 1.1 reads "1e+20" as a string: its floats need a dot.
        mantissa, e, exponent = repr(value).partition("e")
        return f"{mantissa}{'' if '.' in mantissa else '.0'}{e}{exponent}"
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return _quote(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _quote(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif (
            code < 0x20
            or 0x7F <= code <= 0x9F
            or 0xD800 <= code <= 0xDFFF
            or code in (0x2028, 0x2029, 0xFEFF, 0xFFFE, 0xFFFF)
        ):
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _emit(value: object, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            k = _scalar(key)
            if isinstance(item, Mapping) and item:
                lines.append(f"{pad}{k}:")
                _emit(item, indent + 2, lines)
            elif isinstance(item, list) and item:
                lines.append(f"{pad}{k}:")
                _emit(item, indent, lines)
            else:
                lines.append(f"{pad}{k}: {_inline(item)}")
    elif isinstance(value, list) and value:
        for item in value:
            if isinstance(item, Mapping | list) and item:
                sub: list[str] = []
                _emit(item, indent + 2, sub)
                lines.append(f"{pad}- {sub[0][indent + 2 :]}")
                lines.extend(sub[1:])
            else:
                lines.append(f"{pad}- {_inline(item)}")
    else:
        lines.append(pad + _inline(value))


def _inline(value: object) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def dump_yaml(*documents: object) -> str:
    """Block-style YAML for JSON-like data, one ``---``-separated document each.

    Mappings keep their order; strings are quoted whenever a YAML reader could
    take them for anything else.
    """
    parts = []
    for doc in documents:
        lines: list[str] = []
        _emit(doc, 0, lines)
        parts.append("\n".join(lines) + "\n")
    return "---\n".join(parts)
