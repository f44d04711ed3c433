"""Peak activation memory: the most bytes of tensors alive at once, running nodes in order.

A tensor is an activation when it depends on a graph input (data or shape); what is computed
from weights and constants alone is folded into the weights by TensorRT, and the weights, which
every CP rank holds whole, are not counted. A tensor lives from the node that makes it (a graph
input from the start) to the last node that reads it (a graph output to the end); a node's
inputs and outputs are alive together. An element type that is unknown counts 4 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.runtime.memory import DEFAULT_ITEMSIZE, _type_itemsize


def input_dependent(index: GraphIndex) -> set[str]:
    """Tensors computed from some graph input (through shapes too)."""
    found = set(index.graph_inputs)
    for node in index.nodes:
        if not found.isdisjoint(node.inputs):
            found.update(name for name in node.outputs if name)
    return found


def tensor_bytes(shapes: ShapeInference, types: Mapping[str, int]) -> Callable[[str], int | None]:
    def size(tensor: str) -> int | None:
        shape = shapes.shape(tensor)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        elem_type = types.get(tensor)
        itemsize = _type_itemsize(elem_type) if elem_type else DEFAULT_ITEMSIZE
        return math.prod(shape) * itemsize  # type: ignore[arg-type]

    return size


def peak_bytes(
    index: GraphIndex, nodes: Sequence[Node], size: Callable[[str], int | None]
) -> tuple[int, int]:
    """The peak of live activation bytes running ``nodes`` (of ``index``) in order, and how
    many activations had no known size (counted as 0)."""
    activations = input_dependent(index)
    last_use: dict[str, int] = {}
    for step, node in enumerate(nodes):
        for name in node.inputs:
            if name in activations:
                last_use[name] = step
    end = len(nodes)
    for name in index.graph_outputs:
        last_use[name] = end
    unknown = 0
    sizes: dict[str, int] = {}

    def sized(name: str) -> int:
        nonlocal unknown
        if name not in sizes:
            found = size(name)
            if found is None:
                unknown += 1
            sizes[name] = found or 0
        return sizes[name]

    live = sum(sized(name) for name in index.graph_inputs)
    peak = live
    freed_at: dict[int, list[str]] = {}
    for name, step in last_use.items():
        freed_at.setdefault(step, []).append(name)
    for name in index.graph_inputs:
        if name not in last_use:
            live -= sized(name)
    for step, node in enumerate(nodes):
        for name in node.outputs:
            if name and name in activations:
                live += sized(name)
        peak = max(peak, live)
        for name in node.outputs:
            if name and name in activations and name not in last_use:
                live -= sized(name)  # read by nothing
        for name in freed_at.get(step, ()):
            live -= sized(name)
    return peak, unknown
