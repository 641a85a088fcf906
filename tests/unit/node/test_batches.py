"""The broker cuts what it sends into bounded lists with one `_batches`: publish
parts (count and bytes of a subscriber stream) and queue handoffs (bytes)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from geofed.node._server import _batches

_sizes = st.lists(st.integers(min_value=0, max_value=50), max_size=40)


@given(_sizes, st.integers(min_value=1, max_value=60), st.none() | st.integers(1, 8))
def test_batches_keep_order_and_bounds_and_fill_each_list(
    sizes: list[int], budget: int, most: int | None
) -> None:
    items = list(enumerate(sizes))
    parts = list(_batches(items, lambda item: item[1], budget, most=most))
    assert [item for part in parts for item in part] == items
    assert all(parts)
    for i, part in enumerate(parts):
        cost = sum(size for _, size in part)
        assert len(part) == 1 or cost <= budget  # only a lone item may exceed the budget
        assert most is None or len(part) <= most
        if i + 1 < len(parts):  # a list ends only because the next item did not fit
            nxt = parts[i + 1][0][1]
            assert len(part) == most or cost + nxt > budget


def test_an_empty_input_gives_no_list() -> None:
    assert list(_batches([], len, 10)) == []
