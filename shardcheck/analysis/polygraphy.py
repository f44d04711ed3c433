"""Polygraphy 0.53.6's view of a model: its two attention patterns, matched the way
onnx-graphsurgeon matches them, and its walk to the graph inputs and outputs a layer depends on.

Pattern 0 is ``MatMul(q, k) -> Softmax -> MatMul(., v)``. Pattern 1 adds the scale that
PyTorch's SDPA decomposition writes: ``Shape(q) -> Slice -> Cast -> Sqrt -> Cast -> Div(w, .)
-> Cast`` feeding two ``Sqrt`` nodes that scale q and k by ``Mul`` before the first MatMul.

The rules are graphsurgeon's: every tensor inside the pattern has exactly the consumers the
pattern gives it (in node order where there are several), is not a graph output, and each ONNX
node is used once per match. Matches are tried from every node in graph order.

onnx-graphsurgeon 0.6 changed its consumer check so that pattern 1 never matches (it counts the
second ``Sqrt`` as an outside consumer); this module follows 0.5.8, where it matches.

Polygraphy walks back from each layer's second MatMul to every graph input it depends on, and
forward to every graph output that depends on it. Its forward walk stops at a graph output: a
tensor that is an output and also feeds later nodes is suggested, and what lies behind it is
reached only by other paths. Both walks here are linear in the graph and give the tensors in
the model's own input and output order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardcheck.graph.index import GraphIndex, Node


@dataclass(frozen=True)
class PatternMatch:
    """One attention layer as Polygraphy sees it."""

    pattern: int
    q: str
    k: str
    v: str
    matmul1: Node
    softmax: Node
    matmul2: Node


class _Walk:
    """Checks of one match attempt; nodes may be used once."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self.used: set[int] = set()

    def take(self, node: Node, op_type: str, n_inputs: int) -> bool:
        if node.index in self.used or node.op_type != op_type:
            return False
        if len(node.inputs) != n_inputs or len(node.outputs) != 1:
            return False
        self.used.add(node.index)
        return True

    def only_consumers(self, tensor: str, count: int) -> list[Node] | None:
        """The consumers of an internal tensor, when it has exactly ``count`` and is no output."""
        if self.index.is_graph_output(tensor):
            return None
        consumers = self.index.consumers_of(tensor)
        return consumers if len(consumers) == count else None

    def sole_consumer(self, tensor: str, op_type: str, n_inputs: int, position: int) -> Node | None:
        consumers = self.only_consumers(tensor, 1)
        if consumers is None:
            return None
        node = consumers[0]
        if not self.take(node, op_type, n_inputs) or node.inputs[position] != tensor:
            return None
        return node


def _attention_tail(walk: _Walk, matmul1: Node) -> tuple[Node, Node] | None:
    """Softmax and the second MatMul after ``matmul1``."""
    softmax = walk.sole_consumer(matmul1.outputs[0], "Softmax", 1, 0)
    if softmax is None:
        return None
    matmul2 = walk.sole_consumer(softmax.outputs[0], "MatMul", 2, 0)
    if matmul2 is None:
        return None
    return softmax, matmul2


def match_pattern0(index: GraphIndex, root: Node) -> PatternMatch | None:
    walk = _Walk(index)
    if not walk.take(root, "MatMul", 2):
        return None
    tail = _attention_tail(walk, root)
    if tail is None:
        return None
    softmax, matmul2 = tail
    q, k = root.inputs
    return PatternMatch(0, q, k, matmul2.inputs[1], root, softmax, matmul2)


def match_pattern1(index: GraphIndex, root: Node) -> PatternMatch | None:
    walk = _Walk(index)
    if not walk.take(root, "Shape", 1):
        return None
    q = root.inputs[0]
    slice_node = walk.sole_consumer(root.outputs[0], "Slice", 3, 0)
    if slice_node is None:
        return None
    tensor = slice_node.outputs[0]
    for op_type in ("Cast", "Sqrt", "Cast"):
        node = walk.sole_consumer(tensor, op_type, 1, 0)
        if node is None:
            return None
        tensor = node.outputs[0]
    div = walk.sole_consumer(tensor, "Div", 2, 1)
    if div is None:
        return None
    cast3 = walk.sole_consumer(div.outputs[0], "Cast", 1, 0)
    if cast3 is None:
        return None
    sqrts = walk.only_consumers(cast3.outputs[0], 2)
    if sqrts is None or not all(walk.take(s, "Sqrt", 1) for s in sqrts):
        return None
    sqrt_q, sqrt_k = sqrts
    mul_q = walk.sole_consumer(sqrt_q.outputs[0], "Mul", 2, 1)
    mul_k = walk.sole_consumer(sqrt_k.outputs[0], "Mul", 2, 1)
    if mul_q is None or mul_k is None or mul_q.inputs[0] != q:
        return None
    matmul1 = walk.sole_consumer(mul_q.outputs[0], "MatMul", 2, 0)
    if matmul1 is None or matmul1.inputs[1] != mul_k.outputs[0]:
        return None
    if walk.only_consumers(mul_k.outputs[0], 1) is None:
        return None
    tail = _attention_tail(walk, matmul1)
    if tail is None:
        return None
    softmax, matmul2 = tail
    return PatternMatch(1, q, mul_k.inputs[0], matmul2.inputs[1], matmul1, softmax, matmul2)


PATTERNS = {0: match_pattern0, 1: match_pattern1}
# The op each pattern starts at: other nodes are not tried.
ROOT_OPS = {0: "MatMul", 1: "Shape"}
PATTERN_DESCRIPTIONS = {
    0: "pattern 0: MatMul(q, k) -> Softmax -> MatMul(., v)",
    1: "pattern 1: q and k scaled by Sqrt(1/Sqrt(Shape(q)[-1])) -> MatMul -> Softmax -> MatMul",
}


def match_all(index: GraphIndex, pattern: int) -> list[PatternMatch]:
    """Every match of one of Polygraphy's patterns, in graph order."""
    matcher, root_op = PATTERNS[pattern], ROOT_OPS[pattern]
    matches = []
    for node in index.nodes:
        if node.op_type != root_op:
            continue
        match = matcher(index, node)
        if match is not None:
            matches.append(match)
    return matches


def dependent_graph_inputs(index: GraphIndex, starts: Iterable[Node]) -> list[str]:
    return _dependent(index, starts, forward=False)


def dependent_graph_outputs(index: GraphIndex, starts: Iterable[Node]) -> list[str]:
    return _dependent(index, starts, forward=True)


def _dependent(index: GraphIndex, starts: Iterable[Node], *, forward: bool) -> list[str]:
    """The graph outputs (``forward``) or inputs reached from ``starts``, in the graph's order;
    the walk does not go past one."""
    in_order = index.graph_outputs if forward else index.graph_inputs
    terminal = set(in_order)
    found: set[str] = set()
    seen: set[int] = set()
    stack = [node.index for node in starts]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        node = index.nodes[current]
        for tensor in node.outputs if forward else node.inputs:
            if tensor in terminal:
                found.add(tensor)
            elif forward:
                stack.extend(index.consumers.get(tensor, ()))
            elif tensor in index.producer:
                stack.append(index.producer[tensor])
    return [name for name in in_order if name in found]
