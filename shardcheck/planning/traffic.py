"""The bytes each rank receives for each collective of the multi-device model.

Counted as NCCL's ring algorithms move them: an all-gather of a tensor of T bytes (gathered)
sends each rank the N-1 slices it lacks, (N-1)/N·T; a reduce-scatter of T bytes (before the
split) sends each rank N-1 partial slices, (N-1)/N·T. Each collective belongs to a layer: a K,
V or Q gather to its own, a scatter to the first layer whose output follows it in the graph
(the embeddings' scatter to the first layer; DeBERTa's relative positions, scattered after a
layer's score MatMul, to that layer), a gather for readers to the layer whose probabilities
its readers weigh it by (DiffLlama's second half of V), another gather to the first layer after
it; a gather after the last layer to none.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.planning.rank_shapes import RankShapes
from shardcheck.sharding.rewrite import ALL_GATHER, COLLECTIVE_OP


@dataclass(frozen=True)
class Collective:
    """One collective: what it moves, where, and the bytes each rank receives."""

    operation: str  # "reduce_scatter" or "all_gather"
    tensor: str  # the tensor of the original model it scatters or gathers
    axis: int
    # "scatter", "gather K", "gather V", "gather Q", "gather for readers" or "gather output"
    role: str
    layer: int | None  # the layer (by position) it belongs to
    bytes_received: int | None


def collectives(
    shapes: RankShapes,
    layers: Sequence[AttentionLayer],
    ranks: int,
    size: Callable[[str], int | None],
    for_readers: Collection[str] = (),
) -> list[Collective]:
    """Every collective of the multi-device model, in graph order (``size``: the bytes of a
    tensor of the multi-device model on one rank; ``for_readers``: the tensors the extension
    gathers for the nodes that read them beside their layer)."""
    by_node = {tail.collective_node: (name, tail) for name, tail in shapes.sharded.tails.items()}
    roles: dict[str, tuple[str, int]] = {}
    for position, layer in enumerate(layers):
        roles.setdefault(layer.gathered_k, ("gather K", position))
        roles.setdefault(layer.gathered_v, ("gather V", position))
        roles.setdefault(layer.q, ("gather Q", position))
    # The position in the multi-device graph of each layer's first node.
    starts = [shapes.copy_of[min(layer.internal)].index for layer in layers if layer.internal]
    # And of each layer's output.
    producer = shapes.index.producer
    ends = [producer.get(layer.output, len(shapes.index.nodes)) for layer in layers]
    # And the layer computing each tensor inside a layer, in the multi-device graph.
    inside = {
        output: position
        for position, layer in enumerate(layers)
        for at in layer.internal
        if at in shapes.copy_of
        for output in shapes.copy_of[at].outputs
    }
    found = []
    for node in shapes.index.nodes:
        if node.op_type != COLLECTIVE_OP or node.name not in by_node:
            continue
        tail_name, tail = by_node[node.name]
        if tail.operation == ALL_GATHER:
            full = size(node.outputs[0])
            other = "gather for readers" if tail.source in for_readers else "gather output"
            role, layer = roles.get(tail.source, (other, None))
            if role == other:
                layer = _reading_layer(shapes, inside, tail_name)
                if layer is None:
                    layer = _next_layer(starts, node.index)
        else:
            full = size(node.inputs[0])
            role, layer = "scatter", _next_layer(ends, node.index)
        received = None if full is None else full * (ranks - 1) // ranks
        found.append(Collective(tail.operation, tail.source, tail.axis, role, layer, received))
    return found


def _next_layer(positions: Sequence[int], at: int) -> int | None:
    """The first layer whose node at ``positions`` follows ``at`` in the graph."""
    return next((layer for layer, position in enumerate(positions) if position > at), None)


def _reading_layer(shapes: RankShapes, inside: dict[str, int], gathered: str) -> int | None:
    """The first layer with a tensor computed inside it that a reader of ``gathered`` (the
    tail of a gather's chain) reads."""
    found = [
        inside[name]
        for reader in shapes.index.consumers_of(gathered)
        for name in reader.inputs
        if name in inside
    ]
    return min(found, default=None)
