"""The FLOPs of one node, counted from the concrete shapes of its inputs and outputs.

The counting rules (docs/commands.md, "explain"), one multiply-add counted as 2 FLOPs:

- ``MatMul`` (and ``FusedMatMul``, ``MatMulInteger``): 2·M·N·K for each matrix of the broadcast
  batch: 2 · (output elements) · K, K the first input's last axis;
- ``Gemm``: 2·M·N·K, plus M·N for its bias C;
- ``Einsum``: 2 · (the product of every label's size) when a label is summed over, else the
  output's elements;
- ``Conv``: 2 · (output elements) · (input channels per group) · (kernel elements), from the
  weight's shape [M, C/group, k...];
- fused attention (ONNX ``Attention``, com.microsoft ``MultiHeadAttention``,
  ``GroupQueryAttention``): its two products, 2 · (Q elements) · (keys) + 2 · (output
  elements) · (keys); the softmax inside is not counted;
- elementwise ops, normalisations and ``Softmax``: 1 per output element; reductions: 1 per input
  element; ``Identity``, ``Cast``, ``Dropout`` and data movement (``Reshape``, ``Transpose``,
  ``Gather``, ``Concat``, ``Slice``, ``Expand``, collectives...): 0.

None where a shape the rule needs is unknown.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardcheck.analysis.einsum import node_equation
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.graph.ops import (
    ELEMENTWISE,
    MATMULS,
    NORMALISATIONS,
    REDUCTIONS,
    fused_attention_inputs,
)

# The ops whose FLOPs are the products of their operands: "projections and MLP" when one
# operand is a weight (``indexed_weights``), the attention core inside a layer.
PRODUCT_OPS = MATMULS | frozenset(("MatMulInteger", "Gemm", "Einsum", "Conv"))
# The ops that pick or lay out parts of their first input: of a weight, a weight still.
_INDEXING = frozenset(
    ("Gather", "GatherND", "Slice", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity")
) | frozenset(("Cast", "CastLike"))
_FREE = frozenset(("Identity", "Cast", "CastLike", "Dropout"))
_PER_OUTPUT_ELEMENT = (ELEMENTWISE - _FREE) | NORMALISATIONS

Concrete = tuple[int, ...]


def node_flops(shapes: ShapeInference, node: Node) -> int | None:
    """The FLOPs of ``node`` with the shapes of ``shapes`` (rules in the module docstring)."""
    op = node.op_type
    if op in _PER_OUTPUT_ELEMENT:
        out = _concrete(shapes, node.outputs[0] if node.outputs else "")
        return None if out is None else math.prod(out)
    if op in REDUCTIONS:
        source = _concrete(shapes, node.inputs[0] if node.inputs else "")
        return None if source is None else math.prod(source)
    rule = _PRODUCT_RULES.get(op)
    if rule is not None:
        return rule(shapes, node)
    if fused_attention_inputs(node.domain, op) is not None:
        return _fused_attention(shapes, node)
    return 0


def indexed_weights(index: GraphIndex, shapes: ShapeInference, derived: set[str]) -> set[str]:
    """The tensors of ``derived`` (data-derived) that are weights all the same: computed from
    a weight only by indexing ops, with indices from the data, as a mixture of experts picks
    each token's experts' matrices (``Gather``/``GatherND`` of the stacked expert weights).

    A gather counts where each index picks a whole matrix (a slice of two axes or more): an
    embedding lookup picks one row of its table per token, an activation."""
    found: set[str] = set()
    for node in index.nodes:
        if node.op_type not in _INDEXING or not node.inputs or not node.outputs:
            continue
        data = node.inputs[0]
        if not data or not (data in found or data not in derived):
            continue
        if node.op_type.startswith("Gather") and not _picks_matrices(shapes, node):
            continue
        if node.outputs[0] in derived:
            found.add(node.outputs[0])
    return found


def _picks_matrices(shapes: ShapeInference, node: Node) -> bool:
    data_rank = shapes.rank(node.inputs[0])
    if data_rank is None or len(node.inputs) < 2:
        return False
    if node.op_type == "Gather":
        return data_rank - 1 >= 2
    indices = shapes.shape(node.inputs[1])  # GatherND: its last axis indexes the data's first
    if not indices or not isinstance(indices[-1], int) or node.attr("batch_dims", 0):
        return False
    return data_rank - indices[-1] >= 2


def _concrete(shapes: ShapeInference, tensor: str) -> Concrete | None:
    shape = shapes.shape(tensor) if tensor else None
    if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    return shape  # type: ignore[return-value]


def _operands(shapes: ShapeInference, node: Node, count: int) -> list[Concrete] | None:
    if len(node.inputs) < count:
        return None
    found = [_concrete(shapes, name) for name in node.inputs[:count]]
    return None if any(s is None for s in found) else found  # type: ignore[return-value]


def _matmul(shapes: ShapeInference, node: Node) -> int | None:
    operands = _operands(shapes, node, 2)
    out = _concrete(shapes, node.outputs[0])
    if operands is None or out is None or not operands[0]:
        return None
    return 2 * math.prod(out) * operands[0][-1]


def _gemm(shapes: ShapeInference, node: Node) -> int | None:
    operands = _operands(shapes, node, 2)
    out = _concrete(shapes, node.outputs[0])
    if operands is None or out is None or len(operands[0]) != 2:
        return None
    k = operands[0][0] if node.attr("transA", 0) else operands[0][1]
    bias = math.prod(out) if len(node.inputs) > 2 and node.inputs[2] else 0
    return 2 * math.prod(out) * k + bias


def _einsum(shapes: ShapeInference, node: Node) -> int | None:
    operands = _operands(shapes, node, len(node.inputs))
    out = _concrete(shapes, node.outputs[0])
    if operands is None or out is None:
        return None
    equation = node_equation(node, [len(s) for s in operands])
    if equation is None:
        return None
    sizes: dict[str, int] = {}
    for labels, shape in zip(equation.inputs, operands, strict=True):
        for label, size in zip(labels, shape, strict=True):
            sizes[label] = max(size, sizes.get(label, 1))
    if set(sizes) <= set(equation.output):
        return math.prod(out)
    return 2 * math.prod(sizes.values())


def _conv(shapes: ShapeInference, node: Node) -> int | None:
    operands = _operands(shapes, node, 2)
    out = _concrete(shapes, node.outputs[0])
    if operands is None or out is None or len(operands[1]) < 2:
        return None
    return 2 * math.prod(out) * math.prod(operands[1][1:])


def _fused_attention(shapes: ShapeInference, node: Node) -> int | None:
    inputs = fused_attention_inputs(node.domain, node.op_type)
    assert inputs is not None
    q = _concrete(shapes, node.inputs[inputs.q])
    k = _concrete(shapes, node.inputs[inputs.k]) if len(node.inputs) > inputs.k else None
    out = _concrete(shapes, node.outputs[0])
    if q is None or k is None or out is None or len(k) < 2:
        return None
    keys = k[-2]  # [batch, keys, hidden] or [batch, heads, keys, head size]
    return 2 * math.prod(q) * keys + 2 * math.prod(out) * keys


_PRODUCT_RULES: dict[str, Callable[[ShapeInference, Node], int | None]] = {
    **dict.fromkeys(MATMULS | {"MatMulInteger"}, _matmul),
    "Gemm": _gemm,
    "Einsum": _einsum,
    "Conv": _conv,
}
