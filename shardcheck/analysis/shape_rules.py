"""The shape rules: each op's output shapes, and small shape values, from its inputs'.

A rule reads its inputs' infos and small constants from the inference running it (``shapes``)
and returns one TensorInfo per output it knows (None when it knows nothing). Most rules need
their first input's shape and are given it (``shape``); an op without a rule here gives unknown
shapes. The dim arithmetic the rules compute with is in ``analysis.symbolic``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardcheck.analysis.einsum import node_equation
from shardcheck.analysis.symbolic import (
    broadcast,
    dim_of,
    elementwise_value,
    matmul_shape,
    range_length,
    reshape_dims,
    shifted,
    size_of,
    slice_length,
    window_count,
)
from shardcheck.analysis.tensor_info import (
    MAX_VALUE_ELEMENTS,
    TensorInfo,
    raw_ints,
    shape_value,
    small_ints,
)
from shardcheck.graph import protos
from shardcheck.graph.index import Dim, Node, Shape
from shardcheck.graph.ops import (
    ELEMENTWISE,
    FUSED_ATTENTION_OP_TYPES,
    MATMULS,
    MICROSOFT_DOMAIN,
    NORMALISATIONS,
    REDUCTIONS,
    FusedAttentionInputs,
    fused_attention_inputs,
    is_default_domain,
)
from shardcheck.graph.protos import full_onnx
from shardcheck.graph.tensors import INTEGER_TYPES

if TYPE_CHECKING:
    from shardcheck.analysis.shapes import ShapeInference

_EXTERNAL = protos.TensorProto.EXTERNAL
# The symbol of a NonZero's count, the node's index appended.
SELECTED_COUNT = "selected_"


def apply_rule(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
    """The infos of ``node``'s outputs by its op's rule (None: the op has none, or it knows
    nothing of these inputs)."""
    op = node.op_type
    if op in ELEMENTWISE:
        return _elementwise(shapes, node)
    if op in _SAME_SHAPE:
        return [TensorInfo(shapes.input_info(node, 0).shape)]
    rule = _ANY_INPUT_RULES.get(op)
    if rule is not None:
        return rule(shapes, node)
    first = shapes.input_info(node, 0)
    if first.shape is None:
        return _rank_only(shapes, node)
    known_input_rule = _KNOWN_INPUT_RULES.get(op)
    return None if known_input_rule is None else known_input_rule(shapes, node, first.shape)


# ------------------------------------------------------------------ rules, whatever the inputs


def _constant(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
    if not is_default_domain(node.domain):
        return None
    tensor = node.value_tensor()
    if tensor is not None and tensor.data_location != _EXTERNAL:
        dims = tuple(tensor.dims)
        if (
            tensor.data_type not in INTEGER_TYPES
            or len(dims) > 1
            or (dims and dims[0] > MAX_VALUE_ELEMENTS)
        ):
            # No shape value to carry: the dims are all there is to read.
            return [TensorInfo(dims)]
        values = raw_ints(tensor, dims)
        if values is not None:
            return [TensorInfo(dims, values)]
    value = shapes.index.constant_value(node.outputs[0])
    if value is None:
        return None
    return [TensorInfo(tuple(int(d) for d in value.shape), shape_value(value))]


def _constant_of_shape(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
    target = shapes.input_info(node, 0).value
    if target is None:
        return None
    fill_value = _fill_value(node)
    value = None
    if len(target) == 1 and isinstance(target[0], int) and fill_value:
        if target[0] <= MAX_VALUE_ELEMENTS:
            value = tuple(fill_value[:1] * target[0])
    return [TensorInfo(tuple(target), value)]


def _fill_value(node: Node) -> list[int] | None:
    """The value a ConstantOfShape fills with, when it is an integer (0 without one)."""
    fill = node.attr("value")
    if fill is None:
        return [0]
    if fill.data_type not in INTEGER_TYPES:
        return None
    dims = tuple(fill.dims)
    if len(dims) <= 1 and math.prod(dims) <= MAX_VALUE_ELEMENTS:
        values = raw_ints(fill, dims)
        if values is not None:
            return list(values)
    return small_ints(full_onnx().numpy_helper.to_array(fill))


def _range(shapes: ShapeInference, node: Node) -> list[TensorInfo]:
    start, limit, delta = (_whole_number(shapes, node, i) for i in range(3))
    if start is None or limit is None or delta is None:
        return [TensorInfo((None,))]
    if start == (0,) and delta == (1,):
        return [TensorInfo((limit[0],))]
    return [TensorInfo((range_length(start, limit, delta),))]


def _whole_number(shapes: ShapeInference, node: Node, position: int) -> tuple[Dim, ...] | None:
    """A Range input's value: its shape value, or a float constant's that is a whole number
    (positions written ``arange(length, dtype=float)`` start at 0.0 by steps of 1.0, the
    limit a length cast to float, which carries the length's value)."""
    value = shapes.input_info(node, position).value
    if value is not None:
        return value
    number = shapes.index.scalar_constant(node.inputs[position])
    if not isinstance(number, float) or not number.is_integer():
        return None
    return (int(number),)


def _einsum(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
    operands = [shapes.input_info(node, i).shape for i in range(len(node.inputs))]
    equation = node_equation(node, [None if s is None else len(s) for s in operands])
    if equation is None:
        return None
    dims: list[Dim] = []
    for axis in range(len(equation.output)):
        # The dims an output axis is summed or broadcast from: as broadcasting them.
        held: list[Shape] = []
        for position, at in equation.sources(axis) or ():
            shape = operands[position]
            held.append((None if shape is None else shape[at],))
        merged = broadcast(held) if held else None
        dims.append(merged[0] if merged else None)
    return [TensorInfo(tuple(dims))]


def _elementwise(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
    infos = [shapes.input_info(node, i) for i in range(len(node.inputs)) if node.inputs[i]]
    input_shapes = [info.shape for info in infos]
    if any(s is None for s in input_shapes):
        return None
    out = broadcast(input_shapes)  # type: ignore[arg-type]
    value = None
    # A matrix's value is read by the ops that keep its shape alone: its flat elements would
    # broadcast as a vector's.
    matrix = any(len(shape) > 1 for shape in input_shapes)  # type: ignore[arg-type]
    reads_values = not matrix or node.op_type in ("Cast", "Identity")
    if reads_values and any(info.value is not None for info in infos):
        value = elementwise_value(
            node.op_type, [shapes.input_info(node, i).value for i in range(3)]
        )
    return [TensorInfo(out, value)] + [TensorInfo(shapes.input_info(node, 0).shape)] * (
        len(node.outputs) - 1
    )


def _gather_elements(shapes: ShapeInference, node: Node) -> list[TensorInfo]:
    return [TensorInfo(shapes.input_info(node, 1).shape)]


def _gather_nd(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
    """ONNX's GatherND: the indices' shape but its last dim, then the data's dims past the
    batch dims and the indexed ones (the dynamo exporter gathers its padding mask so)."""
    data, indices = shapes.input_info(node, 0).shape, shapes.input_info(node, 1).shape
    if data is None or not indices or not isinstance(indices[-1], int):
        return None
    return [TensorInfo((*indices[:-1], *data[node.attr("batch_dims", 0) + indices[-1] :]))]


def _rank_only(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
    """Unknown dims of a known rank, where the op fixes the rank by itself (its first input's
    shape is unknown): a shape is a vector, a size a scalar, a Reshape has as many axes as its
    target has values (a Concat of known length), a Concat the rank of its known parts."""
    op = node.op_type
    if op == "Transpose" and node.attr("perm"):
        return [TensorInfo((None,) * len(node.attr("perm")))]
    if op == "Shape":
        return [TensorInfo((None,))]
    if op == "Size":
        return [TensorInfo(())]
    if op == "Reshape":
        target = shapes.input_info(node, 1).shape
        if target is not None and len(target) == 1 and isinstance(target[0], int):
            return [TensorInfo((None,) * target[0])]
    if op == "Concat":
        parts = [shapes.input_info(node, i).shape for i in range(len(node.inputs))]
        known = [part for part in parts if part is not None]
        if known:
            return [TensorInfo((None,) * len(known[0]))]
    return None


# ------------------------------------------------------------------ rules of a known first input


def _shape_op(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    dims = shape[slice(node.attr("start", 0), node.attr("end", len(shape)))]
    return [TensorInfo((len(dims),), tuple(dims))]


def _non_zero(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    # The count of what it selects depends on the data: a symbol of its own, so that the
    # rows it selects (an expert's tokens, selections.py) can be followed through reshapes.
    return [TensorInfo((len(shape), f"{SELECTED_COUNT}{node.index}"))]


def _size(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    return [TensorInfo((), None)]


def _transpose(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    perm = node.attr("perm") or list(reversed(range(len(shape))))
    value = None
    rows = _matrix_rows(shape, shapes.input_info(node, 0).value)
    if rows is not None and list(perm) == [1, 0]:
        value = tuple(row[column] for column in range(len(rows[0])) for row in rows)
    return [TensorInfo(tuple(shape[p] for p in perm), value)]


def _matrix_rows(shape: Shape, value: tuple[Dim, ...] | None) -> list[tuple[Dim, ...]] | None:
    """The rows of a matrix's value, where it has one (and at least one row and column)."""
    if value is None or len(shape) != 2 or not all(isinstance(d, int) and d > 0 for d in shape):
        return None
    rows, columns = shape
    if rows * columns != len(value):  # type: ignore[operator]
        return None
    return [value[at * columns : (at + 1) * columns] for at in range(rows)]  # type: ignore[operator]


def _reshape(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    target = shapes.input_info(node, 1).value
    if target is None:
        return _rank_only(shapes, node)
    dims = reshape_dims(shape, target, bool(node.attr("allowzero", 0)))
    value = shapes.input_info(node, 0).value
    if dims is None or (len(dims) > 1 and _matrix_rows(dims, value) is None):
        value = None
    return [TensorInfo(dims, value)]


def _unsqueeze(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    """Unsqueeze, and Squeeze."""
    first_value = shapes.input_info(node, 0).value
    rank = len(shape)
    axes = _axes_of(shapes, node)
    if node.op_type == "Unsqueeze":
        if axes is None:
            return None
        out_rank = rank + len(axes)
        positions = sorted(a % out_rank for a in axes)
        dims = list(shape)
        for a in positions:
            dims.insert(a, 1)
        return [TensorInfo(tuple(dims), first_value if rank == 0 else None)]
    drop = (
        {a % rank for a in axes} if axes is not None else {i for i, d in enumerate(shape) if d == 1}
    )
    kept = tuple(d for i, d in enumerate(shape) if i not in drop)
    value = first_value if len(kept) == 0 and first_value is not None else None
    return [TensorInfo(kept, value)]


def _axes_of(shapes: ShapeInference, node: Node) -> list[int] | None:
    """The ``axes`` of an op that takes them as an attribute or (newer opsets) an input."""
    axes = node.attr("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        axes = shapes.constant_ints(node.inputs[1])
    return axes


def _gather(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    rank = len(shape)
    axis = node.attr("axis", 0) % rank
    indices = shapes.input_info(node, 1)
    if indices.shape is None:
        return None
    dims = shape[:axis] + indices.shape + shape[axis + 1 :]
    value = None
    first_value = shapes.input_info(node, 0).value
    if first_value is not None and rank == 1:
        index_values = shapes.constant_ints(node.inputs[1])
        if index_values is not None:
            value = tuple(first_value[i] for i in index_values)
    return [TensorInfo(dims, value)]


def _concat(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    rank = len(shape)
    parts = [shapes.input_info(node, i) for i in range(len(node.inputs))]
    axis = node.attr("axis", 0) % rank
    if any(p.shape is None for p in parts):
        # Every part has the first's rank: only the length along ``axis`` is unknown.
        return [TensorInfo(shape[:axis] + (None,) + shape[axis + 1 :])]
    total: Dim = 0
    for p in parts:
        dim = p.shape[axis]  # type: ignore[index]
        total = total + dim if isinstance(total, int) and isinstance(dim, int) else None
    if total is None and len(parts) == 1:
        total = parts[0].shape[axis]  # type: ignore[index]
    dims = shape[:axis] + (total,) + shape[axis + 1 :]
    value = None
    if rank == 1 and all(p.value is not None for p in parts):
        value = tuple(v for p in parts for v in p.value)  # type: ignore[union-attr]
    return [TensorInfo(dims, value)]


def _slice(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    value = shapes.input_info(node, 0).value
    starts = shapes.input_info(node, 1).value
    ends = shapes.input_info(node, 2).value
    axes = shapes.constant_ints(node.inputs[3]) if len(node.inputs) > 3 else None
    steps = shapes.constant_ints(node.inputs[4]) if len(node.inputs) > 4 else None
    rank = len(shape)
    if starts is None or ends is None:
        # A Slice keeps the rank, and the dims of the axes it does not slice.
        if axes is None:
            return [TensorInfo((None,) * rank)]
        unknown = {axis % rank for axis in axes if -rank <= axis < rank}
        return [TensorInfo(tuple(None if i in unknown else d for i, d in enumerate(shape)))]
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    dims = list(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= rank
        dims[axis] = slice_length(shape[axis], start, end, step)
    out_value = None
    bounds = all(isinstance(x, int) for x in (*starts, *ends))
    if value is not None and rank == 1 and bounds:
        out_value = tuple(value[slice(starts[0], ends[0], steps[0])])  # type: ignore[misc]
    rows = _matrix_rows(shape, value) if bounds else None
    if rows is not None:
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
            cut = slice(start, end, step)  # type: ignore[misc]
            rows = rows[cut] if axis % rank == 0 else [row[cut] for row in rows]
        out_value = tuple(dim for row in rows for dim in row)
    return [TensorInfo(tuple(dims), out_value)]


def _split(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    rank = len(shape)
    axis = node.attr("axis", 0) % rank
    sizes = node.attr("split")
    if sizes is None and len(node.inputs) > 1 and node.inputs[1]:
        sizes = shapes.constant_ints(node.inputs[1])
    count = len(node.outputs)
    if sizes is None:
        # Equal parts, as num_outputs cuts. Sizes computed at run time (each expert's count
        # of its tokens) get them too: the parts' total, which FLOPs are counted from, holds.
        whole = shape[axis]
        sizes = [whole // count if isinstance(whole, int) else None] * count
    results = []
    for size in sizes:
        dims = list(shape)
        dims[axis] = size
        results.append(TensorInfo(tuple(dims)))
    return results


def _top_k(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    """The values and their indices: the input's shape, with K positions along ``axis`` (K
    read off a shape too: a sort of the whole axis takes its length)."""
    axis = node.attr("axis", -1) % len(shape)
    k = shapes.input_info(node, 1).value if len(node.inputs) > 1 else None
    dims = list(shape)
    dims[axis] = k[0] if k is not None and len(k) == 1 else None
    return [TensorInfo(tuple(dims))] * 2


def _one_hot(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    """The indices' shape with the depth inserted at ``axis`` (-1: last); its value where it
    is a vector (every axis but the last of 1) of known indices, depth and values, as the
    TorchScript exporter builds a Tile's repeats [1, k, 1] of a mixture of experts."""
    axis = node.attr("axis", -1) % (len(shape) + 1)
    depth = shapes.constant_ints(node.inputs[1]) if len(node.inputs) > 1 else None
    depth_dim = depth[0] if depth is not None and len(depth) == 1 else None
    dims = list(shape)
    dims.insert(axis, depth_dim)
    indices = shapes.input_info(node, 0).value
    values = shapes.input_info(node, 2).value if len(node.inputs) > 2 else None
    value = None
    vector = all(d == 1 for d in dims[:-1]) and axis == len(dims) - 1
    known = indices is not None and len(indices) <= 1 and values and len(values) == 2
    if vector and known and isinstance(depth_dim, int) and 0 < depth_dim <= MAX_VALUE_ELEMENTS:
        if all(isinstance(i, int) for i in indices):  # type: ignore[union-attr]
            # An index out of [-depth, depth) is hot nowhere.
            hot = {i % depth_dim for i in indices if -depth_dim <= i < depth_dim}  # type: ignore[union-attr, operator]
            value = tuple(values[1] if i in hot else values[0] for i in range(depth_dim))  # type: ignore[index]
    return [TensorInfo(tuple(dims), value)]


def _matmul(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    other = shapes.input_info(node, 1).shape
    if other is None:
        return None
    return [TensorInfo(matmul_shape(shape, other))]


def _gemm(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    other = shapes.input_info(node, 1).shape
    if other is None or len(shape) != 2 or len(other) != 2:
        return None
    m = shape[1] if node.attr("transA", 0) else shape[0]
    n = other[0] if node.attr("transB", 0) else other[1]
    return [TensorInfo((m, n))]


def _expand(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    target = shapes.input_info(node, 1).value
    if target is None:
        target_len = shapes.input_info(node, 1).shape
        if target_len is None or not isinstance(target_len[0], int):
            return None
        # Expand keeps every dim that is not 1; only those become unknown.
        padded = (1,) * (target_len[0] - len(shape)) + tuple(shape)
        return [TensorInfo(tuple(None if d == 1 else d for d in padded))]
    return [TensorInfo(broadcast([shape, tuple(target)]))]


def _reduce(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    return _reduced(node, shape, _axes_of(shapes, node))


def _arg_extreme(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    # ArgMax, ArgMin: one axis (default 0) reduced to its index (no axis of a scalar).
    return _reduced(node, shape, [node.attr("axis", 0)] if shape else [])


def _reduced(node: Node, shape: Shape, axes: list[int] | None) -> list[TensorInfo]:
    """``shape`` reduced over ``axes`` (all of them where None), kept as 1 unless
    keepdims=0."""
    rank = len(shape)
    axes_set = {a % rank for a in axes} if axes is not None else set(range(rank))
    keep = node.attr("keepdims", 1)
    dims = tuple((1 if keep else None) if i in axes_set else d for i, d in enumerate(shape))
    return [TensorInfo(tuple(d for d in dims if d is not None) if not keep else dims)]


def _flatten(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    rank = len(shape)
    axis = node.attr("axis", 1) % (rank + 1) if rank else 0
    left, right = size_of(shape[:axis]), size_of(shape[axis:])
    return [TensorInfo((dim_of(left), dim_of(right)))]


def _fused_attention(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    inputs = fused_attention_inputs(node.domain, node.op_type)
    if inputs is None:
        return None
    return [TensorInfo(_attention_output(shapes, node, shape, inputs))]


def _attention_output(
    shapes: ShapeInference, node: Node, query: Shape, inputs: FusedAttentionInputs
) -> Shape:
    """Query positions, value width: [batch, seq, v_hidden] or [batch, heads, seq, v]."""
    if inputs.packed:
        return query  # packed QKV weights: the output keeps the input's hidden size
    value = shapes.input_info(node, inputs.v).shape
    if value is None:
        return (*query[:-1], None)
    if len(query) == len(value):
        return (*query[:-1], value[-1])
    if len(query) == 3 and len(value) == 4:
        return (*query[:-1], dim_of(size_of([value[1], value[3]])))
    return (*query[:-1], None)


def _embed_layer_norm(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    """com.microsoft EmbedLayerNormalization (onnxruntime's BERT fusion): the ids'
    [batch, sequence] embedded to the word table's width, the mask's index [batch], the
    embeddings' sum as the first output."""
    ids, words = shape, shapes.input_info(node, 2).shape
    if node.domain != MICROSOFT_DOMAIN or len(ids) != 2 or words is None:
        return None
    embedded = TensorInfo((*ids, words[-1]))
    return [embedded, TensorInfo(ids[:1]), embedded][: len(node.outputs)]


def _pad(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    """Each padded axis grows by its pads (a symbolic length too: MobileBERT pads the
    tokens shifted by one back to the sequence length)."""
    if not is_default_domain(node.domain):
        return None
    rank = len(shape)
    has = [bool(name) for name in node.inputs] + [False] * 4
    pads = shapes.input_info(node, 1).value if has[1] else node.attr("pads")
    axes = shapes.constant_ints(node.inputs[3]) if has[3] else list(range(rank))
    if pads is None or axes is None or len(pads) != 2 * len(axes):
        return [TensorInfo((None,) * rank)]
    dims = list(shape)
    for position, axis in enumerate(axes):
        before, after = pads[position], pads[position + len(axes)]
        if not isinstance(before, int) or not isinstance(after, int) or not -rank <= axis < rank:
            return [TensorInfo((None,) * rank)]
        dim = dims[axis % rank]
        if isinstance(dim, int):
            dims[axis % rank] = dim + before + after
        else:
            dims[axis % rank] = None if dim is None or "*" in dim else shifted(dim, before + after)
    return [TensorInfo(tuple(dims))]


def _conv(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo] | None:
    weight = shapes.input_info(node, 1).shape
    if weight is None:
        return None
    spatial = len(shape) - 2
    kernel = node.attr("kernel_shape") or list(weight[2:])
    strides = node.attr("strides") or [1] * spatial
    dilations = node.attr("dilations") or [1] * spatial
    pads = node.attr("pads") or [0] * (2 * spatial)
    auto_pad = node.attr("auto_pad", b"NOTSET")
    dims: list[Dim] = [shape[0], weight[0]]
    for axis in range(spatial):
        size = shape[2 + axis]
        if not isinstance(kernel[axis], int) or auto_pad not in (b"NOTSET", b"VALID"):
            dims.append(None)
            continue
        span = dilations[axis] * (kernel[axis] - 1) + 1
        dims.append(window_count(size, pads[axis] + pads[axis + spatial] - span, strides[axis]))
    return [TensorInfo(tuple(dims))]


def _tile(shapes: ShapeInference, node: Node, shape: Shape) -> list[TensorInfo]:
    repeats = shapes.input_info(node, 1).value
    if repeats is None or len(repeats) != len(shape):
        return [TensorInfo((None,) * len(shape))]
    return [TensorInfo(tuple(dim_of(size_of([d, r])) for d, r in zip(shape, repeats, strict=True)))]


# ------------------------------------------------------------------ the rules by op

# Ops whose first output has their first input's shape (a scatter writes into a copy of its
# data; an EyeLike is the identity matrix of its input's shape: XLNet's relative shift).
_SAME_SHAPE = NORMALISATIONS | frozenset(
    ["CumSum", "ScatterND", "ScatterElements", "Scatter", "EyeLike", "RotaryEmbedding"]
)
_ANY_INPUT_RULES: dict[str, Callable[[ShapeInference, Node], list[TensorInfo] | None]] = {
    "Constant": _constant,
    "Range": _range,
    "ConstantOfShape": _constant_of_shape,
    "GatherElements": _gather_elements,
    "GatherND": _gather_nd,
    "Einsum": _einsum,
}
_KNOWN_INPUT_RULES: dict[
    str, Callable[[ShapeInference, Node, TensorInfo], list[TensorInfo] | None]
] = {
    "Shape": _shape_op,
    "Size": _size,
    "NonZero": _non_zero,
    "Transpose": _transpose,
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _unsqueeze,
    "Gather": _gather,
    "Concat": _concat,
    "Slice": _slice,
    "Split": _split,
    **dict.fromkeys(MATMULS | {"MatMulInteger"}, _matmul),
    "Gemm": _gemm,
    "Expand": _expand,
    **dict.fromkeys(REDUCTIONS, _reduce),
    **dict.fromkeys(("ArgMax", "ArgMin"), _arg_extreme),
    "Flatten": _flatten,
    **dict.fromkeys(FUSED_ATTENTION_OP_TYPES, _fused_attention),
    "Conv": _conv,
    "Tile": _tile,
    "TopK": _top_k,
    "OneHot": _one_hot,
    "Pad": _pad,
    "EmbedLayerNormalization": _embed_layer_norm,
}
# The ops with a rule: any other gives unknown shapes.
RULE_OPS = ELEMENTWISE | _SAME_SHAPE | _ANY_INPUT_RULES.keys() | _KNOWN_INPUT_RULES.keys()
# The ops whose rule names a symbol after the node itself: two such nodes on the same inputs
# give different results, so neither can stand for the other.
NODE_NAMED_RULE_OPS = frozenset({"NonZero"})
