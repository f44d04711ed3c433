"""Every tensor of a graph as a small integer, for the frontier's walks over the whole graph.

The frontier's rounds walk back over the whole graph several times. Over names (sets and dicts
of strings, each step a hash lookup and a hop to the producer's node object), a step costs more
as the graph outgrows the processor's caches; over integers, with lists indexed by them and
flags in bytearrays, it costs the same whatever the graph's size.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

from shardcheck.graph.index import GraphIndex
from shardcheck.graph.ops import SHAPE_OPS


class TensorIds:
    """Every tensor a node reads or computes, and every graph input, as an integer (``id``,
    and back: ``names``), with the node computing it (``producer``, -1 for none) and that
    node's inputs (``parents``; None for a Shape's or Size's output, whose read tensor is in
    ``shape_read``, and for a tensor no node computes)."""

    def __init__(self, index: GraphIndex) -> None:
        nodes = index.nodes
        # Every tensor a node reads or computes, and the graph inputs ("" is no tensor).
        self.names: list[str] = list(
            dict.fromkeys(chain(index.graph_inputs, index.producer, index.consumers))
        )
        self.id: dict[str, int] = dict(zip(self.names, range(len(self.names)), strict=True))
        count = len(self.names)
        # As in the index, the last node naming an output is its producer.
        self.parents: list[tuple[int, ...] | None] = [None] * count
        self.shape_read: list[int] = [-1] * count
        self.producer: list[int] = [-1] * count
        parents, shape_read, producer = self.parents, self.shape_read, self.producer
        id_of = self.id.__getitem__
        for node in nodes:
            names = node.inputs
            if node.op_type in SHAPE_OPS:
                inputs = None
                read = id_of(names[0]) if names and names[0] else -1
            else:
                inputs = tuple(map(id_of, names if "" not in names else filter(None, names)))
                read = -1
            for output in node.outputs:
                if output:
                    output_id = id_of(output)
                    parents[output_id] = inputs
                    shape_read[output_id] = read
                    producer[output_id] = node.index

    def flags(self, tensors: Iterable[str]) -> bytearray:
        """1 at the id of each of ``tensors`` (names), 0 elsewhere. A name without an id (""
        for an omitted output, say) names nothing a walk can reach: it is left out."""
        flags = bytearray(len(self.names))
        id_of = self.id
        for name in tensors:
            tensor = id_of.get(name)
            if tensor is not None:
                flags[tensor] = 1
        return flags
