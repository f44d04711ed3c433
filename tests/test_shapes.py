"""Symbolic dims through Reshape's -1 and through integer division."""

from __future__ import annotations

import pytest

from shardcheck.graph import Shape
from shardcheck.shapes import _divide, reshape_dims, size_of


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        (("b", "s", 768), (0, 0, 12, -1), ("b", "s", 12, 64)),
        (("b", "s", 12, 64), (0, 0, -1), ("b", "s", 768)),
        (("b", "s", 768), (-1, 768), ("b*s", 768)),
        (("b", "s", 768), ("s", -1, 768), ("s", "b", 768)),
        # Merged dims count their factors: 2 * 8 = 16 is what is left with b.
        (("b", "s*2", 8), ("s", -1), ("s", "16*b")),
        # 7 does not divide 768 * b * s, symbols and all: unknown.
        (("b", "s", 768), (7, -1), (7, None)),
        # x is not a factor of the whole: unknown.
        (("b", "s", 768), (0, "x", -1), ("b", "x", None)),
        (("b", None, 768), (0, -1), ("b", None)),
    ],
)
def test_reshape_infers_the_minus_one_from_symbols_and_integers(
    source: Shape, target: Shape, expected: Shape
) -> None:
    assert reshape_dims(source, target) == expected


def test_sizes_of_equal_products_are_equal() -> None:
    assert size_of(["b", "s", 12]) == size_of(["s*b", 3, 4]) == (12, ("b", "s"))
    assert size_of(["b", "b", 2]) != size_of(["b", 2])
    assert size_of(["b", None]) is None


def test_division_removes_an_integer_factor_only_when_it_divides() -> None:
    assert _divide("2*batch", 2) == "batch"
    assert _divide("4*a*b", 2) == "2*a*b"
    assert _divide("batch", 2) is None
