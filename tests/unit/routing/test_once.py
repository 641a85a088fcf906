"""`once`: computed on first read, then a plain attribute; works on frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from geofed.routing._once import once


@dataclass(frozen=True)
class _Box:
    side: float
    calls: list[float] = field(default_factory=list)

    @once
    def area(self) -> float:
        """The area."""
        self.calls.append(self.side)
        return self.side * self.side


def test_a_value_is_computed_once_per_instance_and_kept_in_its_dict() -> None:
    a, b = _Box(2.0), _Box(3.0)
    assert (a.area, a.area, b.area) == (4.0, 4.0, 9.0)
    assert (a.calls, b.calls) == ([2.0], [3.0])
    assert a.__dict__["area"] == 4.0  # read from there: the descriptor is not called again
    assert isinstance(_Box.__dict__["area"], once) and _Box.area.__doc__ == "The area."
