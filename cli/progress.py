"""Progress of the CLI's long commands: tqdm bars on stderr, on a terminal only.

One library for the whole command line (tqdm). Progress never goes to
stdout, which carries the tables and JSON people pipe; and it is off when
stderr is not a terminal (logs, CI, a pipe), so logs never see carriage
returns or redraws. ``GEOFED_PROGRESS=0`` turns it off on a terminal too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")

__all__ = ["bar", "enabled", "track", "write"]


def enabled(stream: IO[str] | None = None) -> bool:
    """Whether progress may be drawn on `stream` (default stderr): a terminal, not turned off."""
    out = stream if stream is not None else sys.stderr
    if out is None or os.environ.get("GEOFED_PROGRESS", "").strip() in ("0", "no", "off"):
        return False
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def bar(
    desc: str,
    total: int | None = None,
    *,
    unit: str = "op",
    stream: IO[str] | None = None,
    leave: bool = False,
    **kwargs: Any,
) -> tqdm:
    """A tqdm bar on stderr (or `stream`), disabled unless `enabled`.

    With `total` None it counts (rate and elapsed time, no bar). A disabled
    bar accepts every call and draws nothing.
    """
    out = stream if stream is not None else sys.stderr
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=False,
        file=out,
        leave=leave,
        dynamic_ncols=True,
        mininterval=0.2,
        disable=not enabled(out),
        **kwargs,
    )


def track(
    items: Iterable[T],
    desc: str,
    total: int | None = None,
    *,
    unit: str = "op",
    stream: IO[str] | None = None,
) -> Iterator[T]:
    """`items`, counted on a progress bar while they are consumed (see `bar`).

    `total` defaults to ``len(items)`` when `items` has one. The bar is
    closed (and erased) when the iteration ends, also on an error.
    """
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]  # checked: it has a length
    with bar(desc, total, unit=unit, stream=stream) as b:
        if b.disable:
            yield from items
            return
        for item in items:
            yield item
            b.update(1)


def write(text: str, stream: IO[str] | None = None) -> None:
    """Print one line to stderr (or `stream`) without garbling a bar being drawn there."""
    out = stream if stream is not None else sys.stderr
    tqdm.write(text, file=out)
