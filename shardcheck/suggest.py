"""Which graph inputs and outputs an attention layer depends on (Polygraphy's suggestion).

Polygraphy walks back from each layer's second MatMul to every graph input it depends on, and
forward to every graph output that depends on it. Its forward walk stops at a graph output: a
tensor that is an output and also feeds later nodes is suggested, and what lies behind it is
reached only by other paths. Both walks here are linear in the graph and give the tensors in
the model's own input and output order.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardcheck.graph import GraphIndex, Node


def dependent_graph_inputs(index: GraphIndex, starts: Iterable[Node]) -> list[str]:
    graph_inputs = set(index.graph_inputs)
    found: set[str] = set()
    seen: set[int] = set()
    stack = [node.index for node in starts]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for tensor in index.nodes[current].inputs:
            if tensor in graph_inputs:
                found.add(tensor)
            elif tensor in index.producer:
                stack.append(index.producer[tensor])
    return [name for name in index.graph_inputs if name in found]


def dependent_graph_outputs(index: GraphIndex, starts: Iterable[Node]) -> list[str]:
    graph_outputs = set(index.graph_outputs)
    found: set[str] = set()
    seen: set[int] = set()
    stack = [node.index for node in starts]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for tensor in index.nodes[current].outputs:
            if tensor in graph_outputs:
                found.add(tensor)
            else:
                stack.extend(index.consumers.get(tensor, ()))
    return [name for name in index.graph_outputs if name in found]
