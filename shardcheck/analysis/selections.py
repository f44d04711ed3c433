"""Positions a mixture of experts selects: each expert's tokens, read and written back.

Two dispatches select them. transformers 4's experts loop over every expert: ``torch.where`` of
the expert's column of the routing mask (a NonZero) gives the tokens routed to it, a GatherND
reads their rows of the flattened hidden states, the expert's MLP runs on those rows, and a
ScatterND (``index_add_``) adds its output back at the same rows. A sorting dispatch (JetMoE's
mixture of attention heads and MLP, GraniteMoE's parallel experts) sorts every (token, slot)
by its expert (a TopK over the whole flattened axis), reads the tokens' rows in that order (the
sorted positions divided by the slots per token), cuts them by each expert's count into the
experts' parts (a Split by sizes computed at run time), and writes each row back at its
position (a ScatterND).

Every row is its own token's, so on a rank the dispatch runs on the rank's tokens: the mask and
the sort are its slice's, the positions are in that slice, the counts are of its tokens, the
rows read and written are its own. The selected rows are no slice of the single device's (their
count is data-dependent, their order the selection's), but what the ScatterND writes back is.

Along such a selection the walk carries the sequence as along any axis: ``selected_by`` tells
which NonZero or sort an index tensor's entries come from, so that the axis rules read a Gather,
GatherND or ScatterND by such indices as position-wise.
"""

from __future__ import annotations

import re
from collections.abc import Set as AbstractSet

from shardcheck.analysis.shape_rules import SELECTED_COUNT
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import Dim, Node

# The dynamo exporter names a data-dependent size (an unbacked symbol of torch.export) so.
_UNBACKED = re.compile(r"u[0-9]+")
_UNBACKED_IN = re.compile(r"(?<![A-Za-z0-9_])u[0-9]+(?![A-Za-z0-9_])")

# Ops that move a selection's coordinates into an index tensor without changing them (past the
# first operand: axes, starts, ends, a target shape), or round them as an integer division
# does (the dynamo exporter divides by Div, then truncates by Abs, Floor and Sign).
_COORDINATE_CARRIERS = frozenset(
    [
        "Transpose",
        "Slice",
        "Split",
        "Squeeze",
        "Unsqueeze",
        "Cast",
        "Identity",
        "Reshape",
        "Expand",
        "Abs",
        "Floor",
        "Sign",
    ]
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


def holds_selected_count(dim: Dim) -> bool:
    """Whether ``dim`` is computed from a selection's count (``is_selected_count``): a NonZero's
    count times a size, the sum of a dispatch's parts."""
    if not isinstance(dim, str):
        return False
    return SELECTED_COUNT in dim or _UNBACKED_IN.search(dim) is not None


def is_full_sort(shapes: ShapeInference, node: Node) -> bool:
    """Whether TopK ``node`` sorts the whole of its axis (``k`` is the axis's length) for its
    order alone: its indices, a permutation of the axis's positions, are read, its sorted
    values are not (a rank's sorted values would be no slice of the whole's)."""
    if node.op_type != "TopK" or len(node.inputs) < 2 or len(node.outputs) < 2:
        return False
    values = node.outputs[0]
    if values and (values in shapes.index.graph_outputs or shapes.index.consumers_of(values)):
        return False
    shape = shapes.shape(node.inputs[0])
    axis = node.attr("axis", -1)
    if shape is None or not -len(shape) <= axis < len(shape) or shape[axis] is None:
        return False
    return shapes.value(node.inputs[1]) == (shape[axis],)


def selected_by(shapes: ShapeInference, indices: str) -> set[int]:
    """The selections (NonZero nodes, full sorts; indices in the graph) whose positions
    ``indices`` holds, moved unchanged, divided by sizes or combined with each other and with
    sizes, where every entry comes from one; empty where any comes from other data."""
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
        if node.op_type == "NonZero" or (
            node.op_type == "TopK" and name == node.outputs[1] and is_full_sort(shapes, node)
        ):
            found.add(at)
        elif node.op_type in _COORDINATE_CARRIERS:
            stack.append(node.inputs[0])
        elif node.op_type in _COORDINATE_COMBINERS:
            stack.extend(name for name in node.inputs if name and not _is_size(shapes, name))
        elif node.op_type == "Div" and _is_size(shapes, node.inputs[1]):
            # The token of a (token, slot) position: the position divided by the slots.
            stack.append(node.inputs[0])
        else:
            return set()
    return found


def is_counted_split(shapes: ShapeInference, node: Node) -> bool:
    """Whether ``node`` is a Split of a selection into parts it counts at run time (each
    expert's tokens): every part's length along the axis is a selection's count, and the
    sizes are computed, not constants a trace fixed. A rank counts its own tokens, so its
    parts are its tokens' for each expert."""
    if node.op_type != "Split" or len(node.inputs) < 2 or not node.inputs[1]:
        return False
    if shapes.constant_ints(node.inputs[1]) is not None:
        return False
    axis = node.attr("axis", 0)
    for name in node.outputs:
        shape = shapes.shape(name) if name else None
        if shape is None or not -len(shape) <= axis < len(shape):
            return False
        if not is_selected_count(shape[axis]):
            return False
    return True


def selection_counts(shapes: ShapeInference) -> frozenset[str]:
    """The tensors computed for the sizes of counted Splits alone (``is_counted_split``): each
    expert's count of tokens, summed over the tokens of its routing. A rank sums over its own
    tokens, the count its Split needs; such a reduction across the sequence is no read of
    other ranks' positions, nor is the Split's read of its sizes."""
    index = shapes.index
    if not any(is_counted_split(shapes, node) for node in index.nodes if node.op_type == "Split"):
        return frozenset()  # most models: no pass over their nodes' consumers
    outputs = set(index.graph_outputs)
    counts: set[str] = set()
    # Reverse graph order: a tensor's consumers are settled before it is.
    for node in reversed(index.nodes):
        for name in node.outputs:
            if not name or name in outputs:
                continue
            # One that nothing reads (a sort's values beside its indices) counts nothing.
            if all(_counts_with(shapes, user, name, counts) for user in index.consumers_of(name)):
                counts.add(name)
    return frozenset(counts)


def computes_counts(node: Node, counts: AbstractSet[str]) -> bool:
    """Whether ``node`` computes only tensors of ``counts`` (``selection_counts``): it reads
    its inputs for the sizes of counted Splits alone."""
    return bool(counts) and all(name in counts for name in node.outputs if name)


def _counts_with(shapes: ShapeInference, user: Node, tensor: str, counts: set[str]) -> bool:
    """Whether ``user`` reads ``tensor`` for a counted Split's sizes alone: as the sizes, or
    to compute tensors that are counts."""
    if is_counted_split(shapes, user):
        return tensor not in user.inputs[:1] and tensor == user.inputs[1]
    written = [name for name in user.outputs if name]
    return bool(written) and all(name in counts for name in written)


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
    """Each (Split, selection) where the Split cuts what a NonZero or a sort selects into parts
    of fixed sizes. A TorchScript trace keeps the sizes it saw: of a loop over what a NonZero
    lists (the experts its example hit, ``for expert in expert_hit``), of a sorting dispatch's
    experts (each expert's count of its example's tokens). At inputs that select other counts
    the Split fails (a sort's parts, which always add up to the length, go to the wrong experts
    instead), and a rank's slice of the tokens selects its own. Splitting a NonZero's
    coordinates apart (its axis of the input's rank) bakes nothing."""
    index = shapes.index
    found = []
    for node in index.nodes:
        if node.op_type != "Split" or not node.inputs or not _fixed_parts(shapes, node):
            continue
        shape = shapes.shape(node.inputs[0])
        axis = node.attr("axis", 0)
        if shape is None or not -len(shape) <= axis < len(shape):
            continue
        if is_selected_count(shape[axis]):
            selections = selected_by(shapes, node.inputs[0])
        else:
            selections = _rows_selected_by(shapes, node.inputs[0], axis)
        if selections:
            found.append((node, index.nodes[min(selections)]))
    return found


def _rows_selected_by(shapes: ShapeInference, tensor: str, axis: int) -> set[int]:
    """The sorts whose positions pick ``tensor``'s rows along its first ``axis`` (0): a
    Gather or GatherND of rows at indices ``selected_by`` full sorts."""
    node = shapes.index.producer_of(tensor)
    if node is None or len(node.inputs) < 2 or axis % (shapes.rank(tensor) or 1) != 0:
        return set()
    gathers_rows = (node.op_type == "Gather" and node.attr("axis", 0) == 0) or (
        node.op_type == "GatherND" and not node.attr("batch_dims", 0)
    )
    if not gathers_rows:
        return set()
    return {
        at for at in selected_by(shapes, node.inputs[1]) if shapes.index.nodes[at].op_type == "TopK"
    }


def _fixed_parts(shapes: ShapeInference, split: Node) -> bool:
    """Whether ``split``'s part sizes are constants (a trace's), not computed at run time
    (``split_with_sizes`` by counts the model computes follows the count)."""
    if len(split.inputs) > 1 and split.inputs[1]:
        return shapes.constant_ints(split.inputs[1]) is not None
    return split.attr("split") is not None


def describe_baked(shapes: ShapeInference, found: list[tuple[Node, Node]]) -> str:
    """What ``baked_counts`` found, for a message: the first Split and selection, what they
    list (the experts, where a router's TopK picks them), why it matters and what to do."""
    split, selection = found[0]
    parts = len([name for name in split.outputs if name])
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    if selection.op_type == "TopK":
        return (
            f"the trace fixed the experts' counts of the tokens TopK {selection.label} sorts: "
            f"Split {split.label}{more} cuts them into {parts} parts of the sizes its example "
            "counted; at inputs that route other counts its experts take each other's tokens "
            "(wrong results, no error) and at other lengths the model fails, and a rank's "
            "slice of the tokens counts its own, so the experts run whole on every rank. Export "
            "with the dynamo exporter (torch.onnx.export(..., dynamo=True)), whose Split takes "
            "the counts the model computes"
        )
    if _routed(shapes, selection):
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
        f"the trace fixed the count of NonZero {selection.label}: Split {split.label}{more} "
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
