"""Whether the indices of a ScatterND are the identity along an axis: a grid of Ranges.

TorchScript writes a copy into part of a tensor (``k[..., :d] = k_nope``, DeepSeek's MLA K) as a
ScatterND whose indices address every axis by value: ``indices[i0, ..., a] = ia`` on each axis
the copy spans whole, a Range over that axis's length put on its own axis of the grid. Along
such an axis each update is written at its own position, as an elementwise op writes it. A rank
computes it on its slice, its grid built from the length of its own slice of the data.
"""

from __future__ import annotations

from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex, Node

# Ops a length passes on its way from a Shape to a Range's limit, its value unchanged.
_LENGTH_CARRIERS = frozenset(["Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity"])


def identity_along(shapes: ShapeInference, scatter: Node, axis: int) -> bool:
    """Whether ScatterND ``scatter`` writes each update at its own position along the data's
    ``axis``: its indices' entry for that axis is a Range from 0 by 1 over the length of the
    data's own ``axis``, laid along the same axis of the grid. The Range then spans the axis
    whole, in order, and on a rank it spans the rank's slice."""
    index = shapes.index
    data, indices = scatter.inputs[0], scatter.inputs[1]
    grid_rank, data_rank = shapes.rank(indices), shapes.rank(data)
    if grid_rank is None or data_rank is None or not 0 <= axis < min(grid_rank - 1, data_rank):
        return False
    part = _entry(index, shapes, indices, axis, grid_rank)
    if part is None:
        return False
    laid = _laid_range(index, part, grid_rank - 1)
    if laid is None:
        return False
    ranged, grid_axis = laid
    return grid_axis == axis and _reads_length(index, ranged, data, axis, data_rank)


def _entry(
    index: GraphIndex, shapes: ShapeInference, indices: str, axis: int, grid_rank: int
) -> str | None:
    """The tensor that holds the indices' entry ``axis`` alone: the one of the Concat of the
    entries along the last axis that gives it, with its last axis removed."""
    concat = index.producer_of(indices)
    if concat is None or concat.op_type != "Concat":
        return None
    if concat.attr("axis", 0) % grid_rank != grid_rank - 1:
        return None
    start = 0
    for part in concat.inputs:
        shape = shapes.shape(part)
        if not shape or not isinstance(shape[-1], int):
            return None
        if start <= axis < start + shape[-1]:
            if shape[-1] != 1:
                return None
            return _unsqueezed_last(index, part, grid_rank)
        start += shape[-1]
    return None


def _unsqueezed_last(index: GraphIndex, part: str, grid_rank: int) -> str | None:
    node = index.producer_of(part)
    if node is None or node.op_type != "Unsqueeze":
        return None
    axes = index.axes_of(node)
    if axes is None or len(axes) != 1 or axes[0] % grid_rank != grid_rank - 1:
        return None
    return node.inputs[0]


def _laid_range(index: GraphIndex, tensor: str, grid_rank: int) -> tuple[Node, int] | None:
    """The Range from 0 by 1 that ``tensor`` (a grid of rank ``grid_rank``) broadcasts, and the
    grid axis it lies along: Expanded from a Reshape to [-1, 1, ..., 1], whose first axis is
    the one of the grid its rank counts from the right."""
    node = index.producer_of(tensor)
    if node is not None and node.op_type == "Expand":
        node = index.producer_of(node.inputs[0])
    laid_rank = 1
    if node is not None and node.op_type == "Reshape":
        target = index.constant_ints(node.inputs[1])
        if not target or any(size != 1 for size in target[1:]) or target[0] in (0, 1):
            return None
        laid_rank = len(target)
        node = index.producer_of(node.inputs[0])
    if node is None or node.op_type != "Range" or laid_rank > grid_rank:
        return None
    if index.scalar_constant(node.inputs[0]) != 0 or index.scalar_constant(node.inputs[2]) != 1:
        return None
    return node, grid_rank - laid_rank


def _reads_length(index: GraphIndex, ranged: Node, data: str, axis: int, rank: int) -> bool:
    """Whether the Range's limit is the length of ``data``'s ``axis`` (of ``rank`` axes), read
    by a Shape of it."""
    node = index.producer_of(ranged.inputs[1])
    while node is not None and node.op_type in _LENGTH_CARRIERS:
        node = index.producer_of(node.inputs[0])
    if node is None:
        return False
    if node.op_type == "Shape":
        read = range(rank)[slice(node.attr("start"), node.attr("end"))]
        return node.inputs[0] == data and list(read) == [axis]
    if node.op_type != "Gather" or node.attr("axis", 0) != 0:
        return False
    shape = index.producer_of(node.inputs[0])
    if shape is None or shape.op_type != "Shape" or shape.inputs[0] != data:
        return False
    if shape.attr("start") not in (None, 0) or shape.attr("end") is not None:
        return False
    at = index.scalar_constant(node.inputs[1])
    return isinstance(at, int) and -rank <= at < rank and at % rank == axis
