"""The frontier found: the tensors to scatter and to gather, in graph order, and the warnings."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ReaderGather, ShardTensor


@dataclass
class Frontier:
    """The tensors to scatter (``inputs``) and to gather (``outputs``), each in graph order,
    and the warnings of the places where no cut makes CP exact."""

    inputs: list[ShardTensor] = field(default_factory=list)
    outputs: list[ShardTensor] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # The nodes that run on slices before the layers (the region walked back from them), by
    # index: the extension's lengths are given by them (sharding/lengths.py).
    region_nodes: frozenset[int] = frozenset()
    # The extension's outputs gathered for the graph output alone (their other consumers keep
    # the slices), in the order of ``outputs``.
    for_output: tuple[str, ...] = ()
    # The extension's K and V tensors gathered for the nodes that read them beside their
    # layer (frontier/kv_readers.py), by name.
    kv_for_readers: tuple[ReaderGather, ...] = ()


class GraphOrder:
    """A tensor's position in the graph: graph inputs, then initializers, then node outputs
    (by their node). Asked of the few tensors to scatter and gather only."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self.inputs = {name: i for i, name in enumerate(index.graph_inputs)}
        self._initializers: dict[str, int] | None = None

    def __call__(self, tensor: str) -> int:
        index = self.index
        position = self.inputs.get(tensor)
        if position is not None:
            return position
        if tensor in index.initializers:
            if self._initializers is None:
                self._initializers = {name: i for i, name in enumerate(index.initializers)}
            return len(self.inputs) + self._initializers[tensor]
        producer = index.producer.get(tensor)
        if producer is None:
            return 0
        return len(self.inputs) + len(index.initializers) + producer


def in_graph_order(
    order: GraphOrder, shapes: ShapeInference, tensors: dict[str, int]
) -> list[ShardTensor]:
    """``tensors`` (name to axis) as cut tensors, in graph order (ties by name)."""
    return [
        ShardTensor(name, axis, shapes.rank(name))
        for name, axis in sorted(tensors.items(), key=lambda item: (order(item[0]), item[0]))
    ]
