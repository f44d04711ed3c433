"""The forward walk: from the layers' outputs through position-wise ops to the tensors CP
gathers (graph outputs, and the inputs of ops that mix positions), each along its axis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.selections import computes_counts, is_counted_split
from shardcheck.frontier.sources import ShapeSources, sized_by_whole
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.graph.ops import SHAPE_OPS


def gathered_kv(layers: list[AttentionLayer]) -> set[str]:
    """The K and V the layers gather: whole on every rank when read."""
    return {name for layer in layers for name in (layer.gathered_k, layer.gathered_v)}


def walk_forward(
    index: GraphIndex,
    mapper: AxisMapper,
    layers: list[AttentionLayer],
    warnings: list[str],
    sources: ShapeSources | None = None,
    region: set[str] | None = None,
    reads_whole: WholeReads | None = None,
    *,
    sized: bool = True,
    whole_outputs: frozenset[str] = frozenset(),
    given_out: dict[str, int] | None = None,
    counts: AbstractSet[str] = frozenset(),
) -> tuple[dict[str, int], set[int]]:
    """The tensors to gather, and the position-wise nodes after the attention layers; a
    tensor gathered that also feeds position-wise ops is warned of in ``warnings``.

    With ``given_out`` (the extension's walk), a graph output that no op mixing positions
    reads goes there instead, with its axis: it is gathered for the graph output alone.

    With ``reads_whole``, a node that also reads a tensor every rank holds whole along the
    same axis (data, not a broadcast) gets the gathered tensor: ConvBERT concatenates each
    layer's attention heads with its convolution heads, computed whole. With ``sources`` and
    ``region``, and unless ``sized`` is False (the extension gives each node the length it
    needs), a node sized by the Shape of a tensor no rank slices gets the gathered tensor.

    A node that computes a rank's counts of its tokens for each expert (``counts``:
    selections.py) reads its slice as a Shape would, for sizes."""
    barriers = gathered_kv(layers)
    outputs: dict[str, int] = {}
    queue: deque[tuple[str, int]] = deque()
    for layer in layers:
        # ``whole_outputs``: layers computed whole from a gather inside them (exposed.py).
        # Latents attending to the sequence compute their output whole on every rank.
        whole = layer.packed or layer.latents is not None or layer.output in whole_outputs
        if layer.q_axis is not None and not whole:
            rank = mapper.shapes.rank(layer.output)
            if rank is not None:
                axis = layer.output_axis
                queue.append((layer.output, rank - 2 if axis is None else axis))
    seen: set[str] = set() if reads_whole is None else reads_whole.reached
    # The tensor and axis each tensor was first reached from: a gather along a merged axis
    # moves up to where the axis was whole (see _unmerged).
    came_from: dict[str, tuple[str, int]] = {}
    nodes: set[int] = set()
    graph_outputs = set(index.graph_outputs)
    consumers = index.consumers
    all_nodes = index.nodes
    output_axis = mapper.output_axis
    # Only a node with an input computed from a Shape can be sized by a whole tensor.
    sizable = (
        sources.sizable if sized and sources is not None and region is not None else frozenset()
    )
    while queue:
        tensor, axis = queue.popleft()
        if tensor in seen or tensor in barriers:
            continue
        seen.add(tensor)
        if tensor in graph_outputs and given_out is None:
            outputs[tensor] = axis
        mixing = []
        users = 0
        for consumer_index in consumers.get(tensor, ()):
            consumer = all_nodes[consumer_index]
            if consumer.op_type in SHAPE_OPS or index.read_for_shape(consumer):
                continue
            if computes_counts(consumer, counts):
                continue
            users += 1
            out_axis = output_axis(consumer, tensor, axis)
            if out_axis is not None and (
                (
                    consumer_index in sizable and sized_by_whole(consumer, sources, region, seen)  # type: ignore[arg-type]
                )
                or (
                    reads_whole is not None
                    and reads_whole(consumer, tensor, out_axis, mapper, region)  # type: ignore[arg-type]
                )
            ):
                out_axis = None
            if out_axis is None:
                mixing.append(consumer)
            else:
                nodes.add(consumer_index)
                # Every part of a counted Split is one expert's tokens (selections.py).
                written = (
                    consumer.outputs
                    if is_counted_split(mapper.shapes, consumer)
                    else consumer.outputs[:1]
                )
                for output in written:
                    if output:
                        queue.append((output, out_axis))
                        came_from.setdefault(output, (tensor, axis))
                if consumer.op_type == "TopK" and len(consumer.outputs) > 1:
                    # Its indices too (a mixture of experts' picks): what their Shape sizes
                    # is sized by a slice.
                    queue.append((consumer.outputs[1], out_axis))
        if mixing and (tensor not in graph_outputs or given_out is not None):
            outputs[tensor] = axis
        elif tensor in graph_outputs and given_out is not None:
            given_out[tensor] = axis
        if tensor in outputs and len(mixing) != users:
            why = "a graph output" if tensor in graph_outputs else f"read by {mixing[0].label}"
            warnings.append(
                f"{tensor} is gathered ({why}) but also feeds position-wise ops, which would "
                "then get the whole sequence; CP may not be exact"
            )
    return _unmerged(outputs, came_from, mapper), nodes


def _unmerged(
    outputs: dict[str, int], came_from: dict[str, tuple[str, int]], mapper: AxisMapper
) -> dict[str, int]:
    """``outputs`` with each gather along a merged axis whose outer factor is not the
    sequence (``batch*sequence``: the dynamo exporter's GPT-2 flattens its tokens for each
    projection) moved up to the tensor it was walked from before the merge. The ranks' parts of
    such an axis, joined, interleave the batch's rows: exact at batch 1 only."""
    moved: dict[str, int] = {}
    for tensor, axis in outputs.items():
        while _batch_outside(mapper, tensor, axis) and tensor in came_from:
            tensor, axis = came_from[tensor]
        moved.setdefault(tensor, axis)
    return moved


def _batch_outside(mapper: AxisMapper, tensor: str, axis: int) -> bool:
    """Whether ``tensor``'s ``axis`` merges a sequence dim under another dim (batch*sequence)."""
    shape = mapper.shapes.shape(tensor)
    dim = shape[axis] if shape is not None and axis < len(shape) else None
    if not isinstance(dim, str) or "*" not in dim:
        return False
    factors = dim.split("*")
    return any(
        isinstance(seq, str) and seq in factors and factors[0] != seq for seq in mapper.sequences
    )


class WholeReads:
    """Whether a node reached by the walk forward from ``tensor`` reads along ``out_axis``
    another tensor that every rank holds whole: one of ``forced``. Meanwhile the other data
    inputs it reads along the axis that the walks have not found to be slices are kept
    (``pending``, with the node), for the search to settle once the walk has ended."""

    def __init__(self, derived: set[str], forced: set[int], inside_layers: set[int]) -> None:
        self.derived = derived
        self.forced = forced
        # A layer's inside reads its masks whole along the keys: the walk back placed its cuts.
        self.inside_layers = inside_layers
        self.pending: list[tuple[int, str]] = []
        # What the walk forward reached: it fills this set as it goes.
        self.reached: set[str] = set()

    def __call__(
        self, node: Node, tensor: str, out_axis: int, mapper: AxisMapper, region: set[str]
    ) -> bool:
        if node.index in self.forced:
            return True
        inputs = node.inputs
        if len(inputs) < 2 or node.index in self.inside_layers:
            return False
        # The region's tensors and what the walk reached are slices: most nodes read no
        # other data, and the mapper is not asked.
        derived, reached = self.derived, self.reached
        others = [
            name
            for name in inputs
            if name in derived and name != tensor and name not in region and name not in reached
        ]
        if others:
            along = {name for name, _ in mapper.input_axes(node, out_axis) or ()}
            self.pending.extend((node.index, name) for name in others if name in along)
        return False
