"""Dims written as expressions by the dynamo exporter, read as 1 only when they are."""

from __future__ import annotations

import pytest

from shardcheck.analysis.symbolic import always_one, mentions, slice_length
from shardcheck.graph.index import Dim


@pytest.mark.parametrize(
    "dim",
    [
        1,
        "1",
        # MPT's ALiBi bias sliced to one row: 1 for every length >= 1.
        "1 - Max(0, 1 - sequence)",
        "sequence // sequence",
        "Min(1, batch)",
        "Max(1, 2 - sequence) - Max(0, 1 - sequence)",
        "1" + "+0" * 127,  # 255 characters: still read
    ],
)
def test_dims_that_are_one_at_every_size(dim: object) -> None:
    assert always_one(dim)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dim",
    [
        None,
        0,
        2,
        "sequence",
        # The same bias's key axis: the length, up to the 64 rows of the table.
        "64 - Max(0, 64 - sequence)",
        "Max(1, sequence)",
        "2 - sequence",
        "sequence % 2",
        # Unreadable or not an expression of sizes: never taken for 1.
        "1 -",
        "1.0",
        "sequence ** 0",
        "__import__('os').getpid() // __import__('os').getpid()",
        "Max()",
        "1 // 0",
        # Too long or too deep to read (a parse of these exhausts the stack or the memory).
        "1" + "+0" * 100_000,
        "-" * 100_000 + "1",
        "(" * 300 + "1" + ")" * 300,
        "1" + "+0" * 128,  # 257 characters
    ],
)
def test_dims_that_are_not_one_or_cannot_be_read(dim: object) -> None:
    assert not always_one(dim)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dim", "symbol", "named"),
    [
        ("sequence", "sequence", True),
        ("2*sequence - 1", "sequence", True),
        ("Max(0, 1 - sequence)", "sequence", True),
        ("sequence_padded", "sequence", False),
        ("s10", "s1", False),
        ("s1 + s10", "s1", True),
        ("batch", "sequence", False),
        (8, "sequence", False),
        (None, "sequence", False),
        ("seq-len", "seq-len", True),  # not a name: matched as it stands
        ("2*(seq-len)", "seq-len", True),
    ],
)
def test_a_dim_mentions_a_symbol_as_a_whole_name(dim: Dim, symbol: str, named: bool) -> None:
    assert mentions(dim, symbol) is named


# ONNX's "to the end" bound, as the exporters write it.
TO_THE_END = 2**63 - 1


@pytest.mark.parametrize(
    ("start", "length"),
    [
        ("-sequence", "sequence"),
        # The dynamo exporter's x[-n:]: n multiplied by -1 (XLM's position_ids[:, -S:]).
        ("-1*sequence", "sequence"),
        # The last rows of another length: not known.
        ("-1*batch", None),
        ("-2*sequence", None),
    ],
)
def test_the_last_n_rows_of_a_length_n(start: str, length: Dim) -> None:
    assert slice_length("sequence", start, TO_THE_END, 1) == length
