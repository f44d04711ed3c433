"""TorchScript's copy into part of a tensor, ``buffer[..., :c] = values``, as it writes it: a
ScatterND whose indices are a grid of every axis's positions (analysis/index_grid.py).

``copy_nodes`` builds it over [batch, sequence, width] tensors, its sequence entry either the
Range TorchScript writes or one the rule must not follow.
"""

from __future__ import annotations

from conftest import int64_constant
from onnx import NodeProto, TensorProto, helper

# The grid's sequence entry: the Range (``own``), length - 1 minus it (``reversed``), or a
# Range by 2 over twice the length, halved (``by_two``: the same values by another Range).
SEQUENCE_ENTRIES = ("own", "reversed", "by_two")


def copy_nodes(
    buffer: str,
    values: str,
    out: str,
    copied: int,
    *,
    sequence_entry: str = "own",
    length_of: str | None = None,
    prefix: str = "copy",
) -> tuple[list[NodeProto], list[TensorProto]]:
    """The nodes and constants writing ``values`` [batch, sequence, ``copied``] into the first
    ``copied`` columns of ``buffer`` [batch, sequence, width] as ``out``; the grid's sequence
    Range sized by a Shape of ``length_of`` (the buffer where None)."""

    def name(part: str) -> str:
        return f"{prefix}_{part}"

    nodes = [helper.make_node("Shape", [values], [name("grid")])]
    for axis in (0, 1):
        source = (length_of or buffer) if axis == 1 else buffer
        length = name(f"length{axis}")
        nodes += [
            helper.make_node("Shape", [source], [name(f"shape{axis}")]),
            helper.make_node("Gather", [name(f"shape{axis}"), name(f"at{axis}")], [length]),
        ]
        entry_of = sequence_entry if axis == 1 else "own"
        limit, step = length, name("one")
        if entry_of == "by_two":
            nodes.append(helper.make_node("Mul", [length, name("two")], [name("twice")]))
            limit, step = name("twice"), name("two")
        entry = name(f"range{axis}")
        nodes.append(helper.make_node("Range", [name("zero"), limit, step], [entry]))
        if entry_of == "reversed":
            nodes += [
                helper.make_node("Sub", [length, name("one")], [name("last")]),
                helper.make_node("Sub", [name("last"), entry], [name("flipped")]),
            ]
            entry = name("flipped")
        elif entry_of == "by_two":
            nodes.append(helper.make_node("Div", [entry, name("two")], [name("halved")]))
            entry = name("halved")
        # Laid along its own axis of the grid [batch, sequence, copied], then broadcast.
        laid, spread = name(f"laid_range{axis}"), name(f"entry{axis}")
        nodes += [
            helper.make_node("Reshape", [entry, name(f"laid{axis}")], [laid]),
            helper.make_node("Expand", [laid, name("grid")], [spread]),
            helper.make_node("Unsqueeze", [spread, name("last_axis")], [name(f"part{axis}")]),
        ]
    parts = [name(f"part{axis}") for axis in range(3)]
    nodes += [
        helper.make_node("Expand", [name("columns"), name("grid")], [name("entry2")]),
        helper.make_node("Unsqueeze", [name("entry2"), name("last_axis")], [parts[2]]),
        helper.make_node("Concat", parts, [name("where")], axis=-1),
        helper.make_node("ScatterND", [buffer, name("where"), values], [out], name=prefix),
    ]
    constants = {
        "at0": 0,
        "at1": 1,
        "zero": 0,
        "one": 1,
        "two": 2,
        "laid0": [-1, 1, 1],
        "laid1": [-1, 1],
        "last_axis": [-1],
        "columns": list(range(copied)),
    }
    return nodes, [int64_constant(name(key), value) for key, value in constants.items()]
