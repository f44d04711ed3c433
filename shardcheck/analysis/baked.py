"""Reshapes that hold the traced sequence length.

TorchScript's tracing writes the length it ran at into the shapes of some Reshapes (those of
nn.MultiheadAttention's K and V): the model then runs at that length only. Shape inference
shows such a Reshape as one whose input's size holds the sequence symbol and whose output's
size does not: the symbol was replaced by a number.
"""

from __future__ import annotations

from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import is_name, size_of
from shardcheck.graph.index import Dim, GraphIndex, Node


def baked_lengths(index: GraphIndex, shapes: ShapeInference, seq: Dim) -> list[tuple[Node, int]]:
    """Each Reshape that fixes the sequence dim ``seq``, with the length it fixes it to."""
    if not isinstance(seq, str) or not is_name(seq):
        return []
    found = []
    for node in index.nodes:
        if node.op_type != "Reshape":
            continue
        source, target = shapes.shape(node.inputs[0]), shapes.shape(node.outputs[0])
        whole = None if source is None else size_of(source)
        part = None if target is None else size_of(target)
        if whole is None or part is None or seq not in whole[1] or seq in part[1]:
            continue
        others = list(whole[1])
        others.remove(seq)
        # input = whole[0] * seq * others and output = part[0] * others, so seq is their ratio.
        if others == list(part[1]) and whole[0] and part[0] % whole[0] == 0:
            found.append((node, part[0] // whole[0]))
    return found
