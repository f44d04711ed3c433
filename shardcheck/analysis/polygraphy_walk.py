"""Which graph inputs and outputs an attention layer depends on (Polygraphy's suggestion).

Polygraphy walks back from each layer's second MatMul to every graph input it depends on, and
forward to every graph output that depends on it. Its forward walk stops at a graph output: a
tensor that is an output and also feeds later nodes is suggested, and what lies behind it is
reached only by other paths. Both walks here are linear in the graph and give the tensors in
the model's own input and output order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shardcheck.graph.index import GraphIndex, Node


def dependent_graph_inputs(index: GraphIndex, starts: Iterable[Node]) -> list[str]:
    found = _walk(
        index,
        starts,
        edges=lambda node: node.inputs,
        terminal=set(index.graph_inputs),
        next_nodes=lambda tensor: [index.producer[tensor]] if tensor in index.producer else [],
    )
    return [name for name in index.graph_inputs if name in found]


def dependent_graph_outputs(index: GraphIndex, starts: Iterable[Node]) -> list[str]:
    found = _walk(
        index,
        starts,
        edges=lambda node: node.outputs,
        terminal=set(index.graph_outputs),
        next_nodes=lambda tensor: index.consumers.get(tensor, ()),
    )
    return [name for name in index.graph_outputs if name in found]


def _walk(
    index: GraphIndex,
    starts: Iterable[Node],
    *,
    edges: Callable[[Node], Iterable[str]],
    terminal: set[str],
    next_nodes: Callable[[str], Iterable[int]],
) -> set[str]:
    """The terminal tensors reached from ``starts``; the walk does not go past one."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = [node.index for node in starts]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for tensor in edges(index.nodes[current]):
            if tensor in terminal:
                found.add(tensor)
            else:
                stack.extend(next_nodes(tensor))
    return found
