"""What a multi-device model computes a tensor from, read off its graph (the tests' own walk,
not shardcheck's)."""

from __future__ import annotations

import onnx


def shapes_read(graph: onnx.GraphProto, tensor: str) -> set[tuple[str, int]]:
    """The (tensor, start) of every Shape that ``tensor``'s value is computed from."""
    producer = {output: node for node in graph.node for output in node.output}
    found: set[tuple[str, int]] = set()
    pending = [tensor]
    while pending:
        node = producer.get(pending.pop())
        if node is None:
            continue
        if node.op_type == "Shape":
            start = next((a.i for a in node.attribute if a.name == "start"), 0)
            found.add((node.input[0], start))
            continue
        pending.extend(node.input)
    return found
