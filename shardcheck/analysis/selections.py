"""Positions a mixture of experts picks by NonZero: each expert's tokens, read and written back.

transformers 4's experts loop over every expert: ``torch.where`` of the expert's column of the
routing mask (a NonZero) gives the tokens routed to it, a GatherND reads their rows of the
flattened hidden states, the expert's MLP runs on those rows, and a ScatterND (``index_add_``)
adds its output back at the same rows. Every row is its own token's, so on a rank the loop runs
on the rank's tokens: the mask is its slice's, the NonZero gives positions in that slice, the
rows read and written are its own. The selected rows are no slice of the single device's (their
count is data-dependent, their order the NonZero's), but what the ScatterND writes back is.

Along such a selection the walk carries the sequence as along any axis: ``selected_by`` tells
which NonZero an index tensor's entries come from, so that the axis rules read a GatherND or
ScatterND by such indices as position-wise.
"""

from __future__ import annotations

import re

from shardcheck.analysis.shape_rules import SELECTED_COUNT
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import Dim, Node

# The dynamo exporter names a data-dependent size (an unbacked symbol of torch.export) so.
_UNBACKED = re.compile(r"u[0-9]+")

# Ops that move a NonZero's coordinates into an index tensor without changing them (past the
# first operand: axes, starts, ends, a target shape).
_COORDINATE_CARRIERS = frozenset(
    ["Transpose", "Slice", "Split", "Squeeze", "Unsqueeze", "Cast", "Identity", "Reshape", "Expand"]
)
# Ops that combine coordinates, with each other or with sizes: a Concat of the coordinates of
# several axes, the row of the flattened axes (TorchScript indexes an expert's routing weights
# at token * k + slot).
_COORDINATE_COMBINERS = frozenset(["Concat", "Add", "Mul"])
# Ops that compute a size from shapes and constants.
_SIZE_OPS = frozenset(
    ["Gather", "Unsqueeze", "Squeeze", "Cast", "Concat", "Reshape", "Slice", "Add", "Mul"]
)


def is_selected_count(dim: Dim) -> bool:
    """Whether ``dim`` is the count of what a NonZero selects: as the shapes name it
    (shape_rules.py), or as the dynamo exporter declares it."""
    return isinstance(dim, str) and (
        dim.startswith(SELECTED_COUNT) or _UNBACKED.fullmatch(dim) is not None
    )


def selected_by(shapes: ShapeInference, indices: str) -> set[int]:
    """The NonZero nodes (indices in the graph) whose coordinates ``indices`` holds, moved
    unchanged or combined with each other and with sizes, where every entry comes from one;
    empty where any comes from other data."""
    index = shapes.index
    found: set[int] = set()
    stack, seen = [indices], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        at = index.producer.get(name)
        node = None if at is None else index.nodes[at]
        if node is None:
            return set()
        if node.op_type == "NonZero":
            found.add(at)
        elif node.op_type in _COORDINATE_CARRIERS:
            stack.append(node.inputs[0])
        elif node.op_type in _COORDINATE_COMBINERS:
            stack.extend(name for name in node.inputs if name and not _is_size(shapes, name))
        else:
            return set()
    return found


def _is_size(shapes: ShapeInference, tensor: str) -> bool:
    """Whether ``tensor`` is computed from shapes and constants alone."""
    index = shapes.index
    stack, seen = [tensor], set()
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in index.initializers:
            continue
        node = index.producer_of(name)
        if node is None:
            return False
        if node.op_type in ("Shape", "Constant"):
            continue
        if node.op_type not in _SIZE_OPS:
            return False
        stack.extend(node.inputs)
    return True


def baked_counts(shapes: ShapeInference) -> list[tuple[Node, Node]]:
    """Each (Split, NonZero) where the Split cuts the NonZero's count into parts of fixed sizes:
    a TorchScript trace of a loop over what a NonZero lists (the experts its example hit,
    ``for expert in expert_hit``) keeps the count it saw. At inputs that select another count
    the Split fails, and a rank's slice of the tokens selects its own. Splitting a NonZero's
    coordinates apart (its axis of the input's rank) bakes nothing."""
    index = shapes.index
    found = []
    for node in index.nodes:
        if node.op_type != "Split" or not node.inputs:
            continue
        shape = shapes.shape(node.inputs[0])
        axis = node.attr("axis", 0)
        if shape is None or not -len(shape) <= axis < len(shape):
            continue
        if not is_selected_count(shape[axis]) or not _fixed_parts(shapes, node):
            continue
        for at in sorted(selected_by(shapes, node.inputs[0])):
            found.append((node, index.nodes[at]))
            break
    return found


def _fixed_parts(shapes: ShapeInference, split: Node) -> bool:
    """Whether ``split``'s part sizes are constants (a trace's), not computed at run time
    (``split_with_sizes`` by counts the model computes follows the count)."""
    if len(split.inputs) > 1 and split.inputs[1]:
        return shapes.constant_ints(split.inputs[1]) is not None
    return split.attr("split") is not None


def describe_baked(shapes: ShapeInference, found: list[tuple[Node, Node]]) -> str:
    """What ``baked_counts`` found, for a message: the first Split and NonZero, what they
    list (the experts, where a router's TopK picks them), why it matters and what to do."""
    split, nonzero = found[0]
    parts = len([name for name in split.outputs if name])
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    if _routed(shapes, nonzero):
        what = f"the {parts} experts its example routed tokens to"
        then = (
            "so the experts run whole on every rank. Export the experts batched "
            '(transformers 5\'s experts_implementation="batched_mm"), whose dispatch is '
            "followed token by token"
        )
    else:
        what = f"the {parts} entries its example selected"
        then = "so what follows runs whole on every rank"
    return (
        f"the trace fixed the count of NonZero {nonzero.label}: Split {split.label}{more} "
        f"cuts it into {parts} parts, {what}; at inputs that select another count the model "
        f"fails, and a rank's slice of the tokens selects its own, {then}"
    )


def _routed(shapes: ShapeInference, node: Node) -> bool:
    """Whether ``node`` is computed from a TopK (a router's picks)."""
    index = shapes.index
    stack, seen = list(node.inputs), set()
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        producer = index.producer_of(name)
        if producer is None:
            continue
        if producer.op_type == "TopK":
            return True
        stack.extend(producer.inputs)
    return False
