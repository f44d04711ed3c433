"""Axes inside the attention layers, as a rank holds them: the queries a slice, the keys whole.

The extension's shard (sharding/lengths.py) gives the nodes there their lengths by these axes,
and the extension's frontier (frontier/exactness.py) leaves unwarned what that makes exact:
``query_axes``, the Reshapes and Expands of the scores with their queries' axis (to be given a
rank's length there); ``key_slices``, the Slices of a table along the keys that the scores
read (to be given the whole length); ``mask_broadcasts``, the Expands that broadcast a padding
mask along the queries of the scores (to be given a rank's length there).
"""

from __future__ import annotations

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer, sequence_dims
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.graph.ops import ELEMENTWISE, RESIZING_OPS


def query_axes(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> dict[str, int]:
    """The Reshapes and Expands inside ``layers``, with the axis of their output that holds
    the queries: followed from the score MatMul's (its rank less 2) through the nodes
    between it and the context MatMul. Decomposed layers only (a fused node has no inside)."""
    found: dict[str, int] = {}
    if not layers:
        return found
    seq, *others = sequence_dims(shapes, layers)
    mapper = AxisMapper(index, shapes, seq, others)
    for layer in layers:
        if layer.kind != "decomposed" or not layer.internal:
            continue
        scores = index.nodes[layer.internal[0]].outputs[0]
        rank = shapes.rank(scores)
        if rank is None or rank < 2:
            continue
        axes = {scores: rank - 2}
        for at in layer.internal[1:]:
            node = index.nodes[at]
            held = [(name, axes[name]) for name in node.inputs if name in axes]
            if not held or not node.outputs:
                continue
            out_axis = mapper.output_axis(node, *held[0])
            if out_axis is None:
                continue
            axes[node.outputs[0]] = out_axis
            if node.op_type in RESIZING_OPS:
                found[node.name] = out_axis
    return found


def key_slices(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> frozenset[str]:
    """The Slices, outside ``layers``, whose output an elementwise node inside one reads (a
    bias or a mask added to the scores) and that slice only axes which, aligned right against
    that node's output, are its last: the keys'. A rank holds the keys whole there."""
    found: set[str] = set()
    for layer in layers:
        inside = set(layer.internal)
        for at in layer.internal:
            node = index.nodes[at]
            out_rank = shapes.rank(node.outputs[0]) if node.outputs else None
            if node.op_type not in ELEMENTWISE or out_rank is None:
                continue
            for name in node.inputs:
                producer = index.producer_of(name) if name else None
                if producer is None or producer.index in inside or producer.op_type != "Slice":
                    continue
                rank = shapes.rank(name)
                axes = index.constant_ints(producer.inputs[3]) if len(producer.inputs) > 3 else None
                if rank is None or not axes:
                    continue
                if all(axis % rank + out_rank - rank == out_rank - 1 for axis in axes):
                    found.add(producer.name)
    return frozenset(found)


# How many nodes the walk from a mask back to its Expands looks at: a mask's Casts, its
# ``1 - mask`` and masked_fill's Where are a few, and no walk goes up the whole model.
_MASK_WALK = 16


def mask_broadcasts(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> dict[str, int]:
    """The Expands, outside ``layers``, that make a layer's mask by broadcasting a tensor of
    one row along the queries, with their output's queries axis: its rank less 2. A rank
    needs its rows alone there (XLM's dynamo export expands its padding mask [batch, 1, 1,
    keys] by ``attention_mask.shape[1]`` twice)."""
    found: dict[str, int] = {}
    for layer in layers:
        for mask in layer.masks:
            for node in _mask_expands(index, shapes, mask):
                if node.index in layer.internal:
                    continue
                out_rank = shapes.rank(node.outputs[0])
                data = shapes.shape(node.inputs[0])
                if out_rank is None or out_rank < 2 or data is None:
                    continue
                at = len(data) - 2
                if at < 0 or data[at] == 1:
                    found[node.name] = out_rank - 2
    return found


def _mask_expands(index: GraphIndex, shapes: ShapeInference, mask: str) -> list[Node]:
    """The Expands that ``mask`` is made from through elementwise nodes of its rank, the
    first met on each path: its Casts, and under transformers 4 BERT's ``1 - mask`` and
    masked_fill's Where. Of the mask's rank only, so that no walk reaches the positions a
    causal mask compares."""
    rank = shapes.rank(mask)
    found: list[Node] = []
    seen: set[int] = set()
    todo = [mask]
    while todo and len(seen) < _MASK_WALK:
        node = index.producer_of(todo.pop())
        if node is None or node.index in seen or shapes.rank(node.outputs[0]) != rank:
            continue
        seen.add(node.index)
        if node.op_type == "Expand":
            found.append(node)
        elif node.op_type in ELEMENTWISE:
            todo.extend(name for name in node.inputs if name)
    return sorted(found, key=lambda node: node.index)
