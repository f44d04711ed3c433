"""Symbolic shapes, propagated forward through the graph in one pass.

Each tensor gets a shape whose dims are ints, symbols (the dim_param names of graph inputs, such
as ``sequence``) or None when unknown. Small integer tensors that hold shapes (``Shape`` ->
``Gather`` -> ``Concat`` -> ``Reshape``, as TorchScript writes them) carry their values as dims
too, so a ``Reshape`` whose target is computed from ``Shape(x)`` keeps the symbols of ``x``.

Only what axis inference needs is modelled; an op not covered here gives unknown shapes, and the
analysis downstream treats unknown as "cannot follow", never as a guess. Declared shapes
(value_info, as the dynamo exporter writes for every tensor) are used where propagation knows
less.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from shardcheck.analysis.einsum import node_equation
from shardcheck.analysis.symbolic import MAX_EXPRESSION_CHARS, is_name
from shardcheck.graph import protos
from shardcheck.graph.index import INTEGER_TYPES, Dim, GraphIndex, Node, Shape, raw_values
from shardcheck.graph.protos import full_onnx

if TYPE_CHECKING:
    import numpy as np
    import onnx

MAX_VALUE_ELEMENTS = 16

ELEMENTWISE = frozenset(
    "Add Sub Mul Div Pow Mod Max Min Where Equal Less Greater LessOrEqual GreaterOrEqual And Or "
    "Xor Not Cast CastLike Sqrt Erf Tanh Relu Gelu FastGelu Sigmoid Neg Exp Log IsNaN IsInf Abs "
    "Reciprocal Clip Floor Ceil Round Sin Cos Identity Dropout Softmax LogSoftmax HardSigmoid "
    "LeakyRelu Elu Selu Softplus QuickGelu BiasGelu Sign Trilu".split()
)
SAME_SHAPE = frozenset(
    "LayerNormalization SimplifiedLayerNormalization SkipLayerNormalization "
    "SkipSimplifiedLayerNormalization BatchNormalization "
    "InstanceNormalization RMSNormalization LpNormalization CumSum".split()
)


class TensorInfo(NamedTuple):
    shape: Shape | None = None
    value: tuple[Dim, ...] | None = None  # for small 1-D/scalar integer tensors


_UNKNOWN = TensorInfo()
# Nodes larger than this, serialized, whose ops take a tensor attribute (a Constant's value) get
# no memo key: serializing a large tensor costs more than the rule.
MAX_MEMO_NODE_BYTES = 512
_TENSOR_ATTRIBUTE_OPS = frozenset(("Constant", "ConstantOfShape"))
_EXTERNAL = protos.TensorProto.EXTERNAL


def _broadcast(shapes: Sequence[Shape]) -> Shape | None:
    first = shapes[0]
    if len(shapes) == 2:
        if shapes[1] == first:
            return first
    elif all(s == first for s in shapes):
        return first
    rank = max(len(s) for s in shapes)
    result: list[Dim] = []
    for axis in range(rank):
        dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        if all(d == 1 for d in dims):
            result.append(1)
            continue
        # An unknown dim beside a known one other than 1 is 1 or equal to it: either way the
        # result is the known one.
        known = [d for d in dims if d != 1 and d is not None]
        if not known:
            result.append(None)
        elif len(set(known)) == 1:
            result.append(known[0])
        else:
            # Two different symbols (or a symbol and an int > 1): equal at run time.
            ints = [d for d in known if isinstance(d, int)]
            result.append(ints[0] if ints else known[0])
    return tuple(result)


Size = tuple[int, tuple[str, ...]]  # a product of dims: integer factor, symbols sorted


def size_of(dims: Sequence[Dim]) -> Size | None:
    """A product of dims as its integer factor and its symbols, sorted (merged dims are
    written ``a*b``), so that equal products have equal sizes; None when a dim is unknown."""
    number = 1
    symbols: list[str] = []
    for dim in dims:
        if dim is None:
            return None
        if isinstance(dim, int):
            number *= dim
            continue
        for factor in dim.split("*"):
            if factor.isdigit():
                number *= int(factor)
            else:
                symbols.append(factor)
    symbols.sort()
    return number, tuple(symbols)


def _quotient(whole: Size, part: Size) -> Size | None:
    """``whole`` / ``part``, when ``part``'s symbols are among ``whole``'s and its integer
    factor divides ``whole``'s."""
    remaining = list(whole[1])
    for symbol in part[1]:
        if symbol not in remaining:
            return None
        remaining.remove(symbol)
    if part[0] == 0 or whole[0] % part[0]:
        return None
    return whole[0] // part[0], tuple(remaining)


def _window_count(size: Dim, extra: int, stride: int) -> Dim:
    """How many windows a convolution fits along a dim: ``(size + extra) // stride + 1``
    (``extra``: the padding less the window's span). A symbolic dim gives an expression over
    it (audio encoders' strided convolutions over the samples), a product of symbols none."""
    if isinstance(size, int):
        return (size + extra) // stride + 1
    if size is None or "*" in size or stride < 1:
        return None
    if stride == 1:
        return _shifted(size, extra + 1)
    inner = _shifted(size, extra)
    return None if inner is None else f"({inner})//{stride} + 1"


_TRAILING_TERM = re.compile(r"^(.+) ([+-]) (\d+)$")


def _shifted(dim: str, shift: int) -> Dim:
    """The symbolic ``dim`` plus ``shift``, a trailing integer term folded in, so that equal
    sizes are written alike: ``s + 1`` shifted by -1 is ``s``. Unknown (None) for a dim too
    long to be read as an expression (a hostile model's dim_param)."""
    if len(dim) > MAX_EXPRESSION_CHARS:
        return None
    if not shift:
        return dim
    match = _TRAILING_TERM.match(dim)
    if match is not None:
        base, sign, number = match.groups()
        return _shifted(base, shift + (int(number) if sign == "+" else -int(number)))
    shifted = f"{dim} {'+' if shift > 0 else '-'} {abs(shift)}"
    return shifted if len(shifted) <= MAX_EXPRESSION_CHARS else None


def _dim_of(size: Size | None) -> Dim:
    if size is None:
        return None
    number, symbols = size
    if not symbols:
        return number
    factors = list(symbols)
    if number != 1:
        factors.insert(0, str(number))
    return "*".join(factors)


def reshape_dims(source: Shape, target: Sequence[Dim], allowzero: bool = False) -> Shape | None:
    dims = list(target)
    for axis, dim in enumerate(dims):
        if dim == 0 and not allowzero:
            if axis >= len(source):
                return None
            dims[axis] = source[axis]
    if -1 in dims:
        position = dims.index(-1)
        whole = size_of(source)
        rest = size_of([d for i, d in enumerate(dims) if i != position])
        dims[position] = None if whole is None or rest is None else _dim_of(_quotient(whole, rest))
    return tuple(dims)


def _ints(value: np.ndarray | None) -> list[int] | None:
    if value is None or value.dtype.kind not in "iu" or value.size > MAX_VALUE_ELEMENTS:
        return None
    return [int(v) for v in value.reshape(-1)]


class ShapeInference:
    """Shapes and small shape values of every tensor of the main graph."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self.info: dict[str, TensorInfo] = {}
        for name in index.graph_inputs:
            self.info[name] = TensorInfo(index.declared_shape(name))
        # Constants (initializers, Constant outputs) and those among them whose integer data a
        # rule may read (_constant_ints) although their info holds no value.
        self._constants = set(index.initializers)
        self._read_by_name: set[str] = set()
        for name, tensor in index.initializers.items():
            dims = tuple(tensor.dims)
            value = None
            if len(dims) <= 1 and _is_small(tensor):
                value = _raw_ints(tensor, dims)
                if value is None:
                    value = _as_value(index.constant_value(name))
            self.info[name] = TensorInfo(dims, value)
            if value is None and _few_integers(tensor.data_type, dims):
                self._read_by_name.add(name)
        nodes = index.nodes
        self._constants.update(
            name for name, at in index.producer.items() if nodes[at].op_type == "Constant"
        )
        # The rules' results (and whether a Constant's output is read by name), by what they
        # depend on (see _memo_key).
        self._results: dict[tuple[object, ...], tuple[list[TensorInfo] | None, bool]] = {}
        for node in index.nodes:
            self._infer(node)

    def shape(self, tensor: str) -> Shape | None:
        info = self.info.get(tensor)
        return None if info is None else info.shape

    def rank(self, tensor: str) -> int | None:
        shape = self.shape(tensor)
        return None if shape is None else len(shape)

    def value(self, tensor: str) -> tuple[Dim, ...] | None:
        info = self.info.get(tensor)
        return None if info is None else info.value

    # ------------------------------------------------------------------ per op

    def _infer(self, node: Node) -> None:
        key = self._memo_key(node)
        known = None if key is None else self._results.get(key)
        if known is None:
            try:
                results = self._rule(node)
            except (ValueError, IndexError, TypeError, KeyError, ZeroDivisionError):
                results = None
            read_by_name = node.op_type == "Constant" and self._read_by_name_after(node, results)
            if key is not None:
                self._results[key] = (results, read_by_name)
        else:
            results, read_by_name = known
        if read_by_name:
            self._read_by_name.add(node.outputs[0])
        info_of = self.info
        outputs = node.outputs
        if results and len(outputs) == 1:
            # The usual node: one output, its shape fully known (nothing declared to add).
            info = results[0]
            if info.shape is not None and None not in info.shape and outputs[0]:
                info_of[outputs[0]] = info
                return
        for position, output in enumerate(outputs):
            if not output:
                continue
            info = results[position] if results and position < len(results) else _UNKNOWN
            if info.shape is None or None in info.shape:
                declared = self.index.declared_shape(output)
                if declared is not None:
                    info = TensorInfo(_merge(declared, info.shape), info.value)
            info_of[output] = info

    def _memo_key(self, node: Node) -> tuple[object, ...] | None:
        """What a rule's result depends on: the op, its domain, attributes and number of
        outputs, and each input's info and whether it is a constant (_constant_ints reads a
        constant's values from its info). A transformer's layers repeat the same nodes on the
        same shapes: each rule runs once per distinct key. None where the rule has to run: an
        op without a rule, a large tensor attribute (serializing it would cost more than the
        rule), an input whose data the rule may read by name."""
        op = node.op_type
        if op not in _RULE_OPS:
            return None
        proto = node.proto
        if op in _TENSOR_ATTRIBUTE_OPS and proto.ByteSize() > MAX_MEMO_NODE_BYTES:
            return None
        if self._read_by_name and not self._read_by_name.isdisjoint(node.inputs):
            return None
        info_get = self.info.get
        constants = self._constants
        inputs = tuple(
            [(info_get(n, _UNKNOWN), n in constants) if n else None for n in node.inputs]
        )
        attributes = tuple([attribute.SerializeToString() for attribute in proto.attribute])
        return (op, node.domain, len(node.outputs), attributes, inputs)

    def _read_by_name_after(self, node: Node, results: list[TensorInfo] | None) -> bool:
        """Whether a Constant's output may be a constant whose integer data _constant_ints
        reads: its info holds no value, and it may hold few integers (or its rule failed)."""
        if results and results[0].value is not None:
            return False
        tensor = node.value_tensor()
        if tensor is None:  # value_int(s) or value_float(s): few ints are in the info
            return not results
        return _few_integers(tensor.data_type, tuple(tensor.dims))

    def _in(self, node: Node, position: int) -> TensorInfo:
        inputs = node.inputs
        if position >= len(inputs) or not inputs[position]:
            return _UNKNOWN
        return self.info.get(inputs[position], _UNKNOWN)

    def _rule(self, node: Node) -> list[TensorInfo] | None:
        op = node.op_type
        if op in ELEMENTWISE:
            return self._elementwise(node)
        if op in SAME_SHAPE:
            return [TensorInfo(self._in(node, 0).shape)]
        rule = _ANY_INPUT_RULES.get(op)
        if rule is not None:
            return rule(self, node)
        first = self._in(node, 0)
        if first.shape is None:
            return self._rank_only(node)
        rule = _KNOWN_INPUT_RULES.get(op)
        return None if rule is None else rule(self, node, first)

    # ------------------------------------------------------------------ rules by op

    def _constant(self, node: Node) -> list[TensorInfo] | None:
        if node.domain not in ("", "ai.onnx"):
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
            values = _raw_ints(tensor, dims)
            if values is not None:
                return [TensorInfo(dims, values)]
        value = self.index.constant_value(node.outputs[0])
        if value is None:
            return None
        return [TensorInfo(tuple(int(d) for d in value.shape), _as_value(value))]

    def _einsum(self, node: Node) -> list[TensorInfo] | None:
        shapes = [self._in(node, i).shape for i in range(len(node.inputs))]
        equation = node_equation(node, [None if s is None else len(s) for s in shapes])
        if equation is None:
            return None
        dims: list[Dim] = []
        for axis in range(len(equation.output)):
            # The dims an output axis is summed or broadcast from: as broadcasting them.
            held: list[Shape] = []
            for position, at in equation.sources(axis) or ():
                shape = shapes[position]
                held.append((None if shape is None else shape[at],))
            merged = _broadcast(held) if held else None
            dims.append(merged[0] if merged else None)
        return [TensorInfo(tuple(dims))]

    def _elementwise(self, node: Node) -> list[TensorInfo] | None:
        infos = [self._in(node, i) for i in range(len(node.inputs)) if node.inputs[i]]
        shapes = [info.shape for info in infos]
        if any(s is None for s in shapes):
            return None
        out = _broadcast(shapes)  # type: ignore[arg-type]
        value = None
        if any(info.value is not None for info in infos):
            value = _elementwise_value(node.op_type, [self._in(node, i).value for i in range(3)])
        return [TensorInfo(out, value)] + [TensorInfo(self._in(node, 0).shape)] * (
            len(node.outputs) - 1
        )

    def _gather_elements(self, node: Node) -> list[TensorInfo]:
        return [TensorInfo(self._in(node, 1).shape)]

    def _shape_op(self, node: Node, first: TensorInfo) -> list[TensorInfo]:
        shape = first.shape
        assert shape is not None
        dims = shape[slice(node.attr("start", 0), node.attr("end", len(shape)))]
        return [TensorInfo((len(dims),), tuple(dims))]

    def _size(self, node: Node, first: TensorInfo) -> list[TensorInfo]:
        return [TensorInfo((), None)]

    def _transpose(self, node: Node, first: TensorInfo) -> list[TensorInfo]:
        shape = first.shape
        assert shape is not None
        perm = node.attr("perm") or list(reversed(range(len(shape))))
        return [TensorInfo(tuple(shape[p] for p in perm))]

    def _reshape(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        target = self._in(node, 1).value
        if target is None:
            return self._rank_only(node)
        dims = reshape_dims(first.shape, target, bool(node.attr("allowzero", 0)))  # type: ignore[arg-type]
        value = first.value if dims is not None and len(dims) <= 1 else None
        return [TensorInfo(dims, value)]

    def _unsqueeze(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        shape = first.shape
        assert shape is not None
        rank = len(shape)
        axes = self._axes_of(node)
        if node.op_type == "Unsqueeze":
            if axes is None:
                return None
            out_rank = rank + len(axes)
            positions = sorted(a % out_rank for a in axes)
            dims = list(shape)
            for a in positions:
                dims.insert(a, 1)
            return [TensorInfo(tuple(dims), first.value if rank == 0 else None)]
        drop = (
            {a % rank for a in axes}
            if axes is not None
            else {i for i, d in enumerate(shape) if d == 1}
        )
        kept = tuple(d for i, d in enumerate(shape) if i not in drop)
        value = first.value if len(kept) == 0 and first.value is not None else None
        return [TensorInfo(kept, value)]

    def _axes_of(self, node: Node) -> list[int] | None:
        """The ``axes`` of an op that takes them as an attribute or (newer opsets) an input."""
        axes = node.attr("axes")
        if axes is None and len(node.inputs) > 1 and node.inputs[1]:
            axes = self._constant_ints(node.inputs[1])
        return axes

    def _constant_ints(self, tensor: str) -> list[int] | None:
        """The values of a small integer constant (initializer or Constant output)."""
        info = self.info.get(tensor)
        # The same test of constness as the memo keys' (_memo_key): they must agree.
        if info is not None and info.value is not None and tensor in self._constants:
            return list(info.value)  # type: ignore[arg-type]
        return _ints(self.index.constant_value(tensor))

    def _gather(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        shape = first.shape
        assert shape is not None
        rank = len(shape)
        axis = node.attr("axis", 0) % rank
        indices = self._in(node, 1)
        if indices.shape is None:
            return None
        dims = shape[:axis] + indices.shape + shape[axis + 1 :]
        value = None
        if first.value is not None and rank == 1:
            index_values = self._constant_ints(node.inputs[1])
            if index_values is not None:
                value = tuple(first.value[i] for i in index_values)
        return [TensorInfo(dims, value)]

    def _concat(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        shape = first.shape
        assert shape is not None
        rank = len(shape)
        parts = [self._in(node, i) for i in range(len(node.inputs))]
        if any(p.shape is None for p in parts):
            return None
        axis = node.attr("axis", 0) % rank
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

    def _slice_rule(self, node: Node, first: TensorInfo) -> list[TensorInfo]:
        return [self._slice(node, first.shape, first.value)]  # type: ignore[arg-type]

    def _split_rule(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        return self._split(node, first.shape)  # type: ignore[arg-type]

    def _matmul_rule(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        other = self._in(node, 1).shape
        if other is None:
            return None
        return [TensorInfo(_matmul(first.shape, other))]  # type: ignore[arg-type]

    def _gemm(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        shape = first.shape
        assert shape is not None
        other = self._in(node, 1).shape
        if other is None or len(shape) != 2 or len(other) != 2:
            return None
        m = shape[1] if node.attr("transA", 0) else shape[0]
        n = other[0] if node.attr("transB", 0) else other[1]
        return [TensorInfo((m, n))]

    def _expand(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        shape = first.shape
        assert shape is not None
        target = self._in(node, 1).value
        if target is None:
            target_len = self._in(node, 1).shape
            if target_len is None or not isinstance(target_len[0], int):
                return None
            # Expand keeps every dim that is not 1; only those become unknown.
            padded = (1,) * (target_len[0] - len(shape)) + tuple(shape)
            return [TensorInfo(tuple(None if d == 1 else d for d in padded))]
        return [TensorInfo(_broadcast([shape, tuple(target)]))]

    def _reduce(self, node: Node, first: TensorInfo) -> list[TensorInfo]:
        shape = first.shape
        assert shape is not None
        rank = len(shape)
        axes = self._axes_of(node)
        axes_set = {a % rank for a in axes} if axes is not None else set(range(rank))
        keep = node.attr("keepdims", 1)
        dims = tuple((1 if keep else None) if i in axes_set else d for i, d in enumerate(shape))
        return [TensorInfo(tuple(d for d in dims if d is not None) if not keep else dims)]

    def _flatten(self, node: Node, first: TensorInfo) -> list[TensorInfo]:
        shape = first.shape
        assert shape is not None
        rank = len(shape)
        axis = node.attr("axis", 1) % (rank + 1) if rank else 0
        left, right = size_of(shape[:axis]), size_of(shape[axis:])
        return [TensorInfo((_dim_of(left), _dim_of(right)))]

    def _fused_attention(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        if node.domain not in ("", "ai.onnx", "com.microsoft"):
            return None
        return [TensorInfo(self._attention_output(node, first.shape))]  # type: ignore[arg-type]

    def _embed_layer_norm(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        """com.microsoft EmbedLayerNormalization (onnxruntime's BERT fusion): the ids'
        [batch, sequence] embedded to the word table's width, the mask's index [batch], the
        embeddings' sum as the first output."""
        ids, words = first.shape, self._in(node, 2).shape
        if node.domain != "com.microsoft" or ids is None or len(ids) != 2 or words is None:
            return None
        embedded = TensorInfo((*ids, words[-1]))
        return [embedded, TensorInfo(ids[:1]), embedded][: len(node.outputs)]

    def _pad(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        """Each padded axis grows by its pads (a symbolic length too: MobileBERT pads the
        tokens shifted by one back to the sequence length)."""
        shape = first.shape
        assert shape is not None
        if node.domain not in ("", "ai.onnx"):
            return None
        rank = len(shape)
        has = [bool(name) for name in node.inputs] + [False] * 4
        pads = self._in(node, 1).value if has[1] else node.attr("pads")
        axes = self._constant_ints(node.inputs[3]) if has[3] else list(range(rank))
        if pads is None or axes is None or len(pads) != 2 * len(axes):
            return [TensorInfo((None,) * rank)]
        dims = list(shape)
        for position, axis in enumerate(axes):
            before, after = pads[position], pads[position + len(axes)]
            if (
                not isinstance(before, int)
                or not isinstance(after, int)
                or not -rank <= axis < rank
            ):
                return [TensorInfo((None,) * rank)]
            dim = dims[axis % rank]
            if isinstance(dim, int):
                dims[axis % rank] = dim + before + after
            else:
                dims[axis % rank] = (
                    None if dim is None or "*" in dim else _shifted(dim, before + after)
                )
        return [TensorInfo(tuple(dims))]

    def _conv_rule(self, node: Node, first: TensorInfo) -> list[TensorInfo] | None:
        return self._conv(node, first.shape)  # type: ignore[arg-type]

    def _tile(self, node: Node, first: TensorInfo) -> list[TensorInfo]:
        shape = first.shape
        assert shape is not None
        repeats = self._in(node, 1).value
        if repeats is None or len(repeats) != len(shape):
            return [TensorInfo((None,) * len(shape))]
        return [
            TensorInfo(tuple(_dim_of(size_of([d, r])) for d, r in zip(shape, repeats, strict=True)))
        ]

    def _attention_output(self, node: Node, query: Shape) -> Shape:
        """Query positions, value width: [batch, seq, v_hidden] or [batch, heads, seq, v]."""
        if node.domain == "com.microsoft" and node.op_type == "Attention":
            return query  # packed QKV weights: the output keeps the input's hidden size
        value = self._in(node, 2).shape
        if value is None:
            return (*query[:-1], None)
        if len(query) == len(value):
            return (*query[:-1], value[-1])
        if len(query) == 3 and len(value) == 4:
            return (*query[:-1], _dim_of(size_of([value[1], value[3]])))
        return (*query[:-1], None)

    def _rank_only(self, node: Node) -> list[TensorInfo] | None:
        """Unknown dims of a known rank, where the op fixes the rank by itself."""
        if node.op_type == "Transpose" and node.attr("perm"):
            return [TensorInfo((None,) * len(node.attr("perm")))]
        if node.op_type == "Reshape":
            target = self._in(node, 1).shape
            if target is not None and len(target) == 1 and isinstance(target[0], int):
                return [TensorInfo((None,) * target[0])]
        return None

    def _conv(self, node: Node, shape: Shape) -> list[TensorInfo] | None:
        weight = self._in(node, 1).shape
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
            dims.append(
                _window_count(size, pads[axis] + pads[axis + spatial] - span, strides[axis])
            )
        return [TensorInfo(tuple(dims))]

    def _fill_value(self, node: Node) -> list[int] | None:
        """The value a ConstantOfShape fills with, when it is an integer (0 without one)."""
        fill = node.attr("value")
        if fill is None:
            return [0]
        if fill.data_type not in INTEGER_TYPES:
            return None
        dims = tuple(fill.dims)
        if len(dims) <= 1 and math.prod(dims) <= MAX_VALUE_ELEMENTS:
            values = _raw_ints(fill, dims)
            if values is not None:
                return list(values)
        return _ints(full_onnx().numpy_helper.to_array(fill))

    def _generator_rule(self, node: Node) -> list[TensorInfo] | None:
        op = node.op_type
        if op == "ConstantOfShape":
            target = self._in(node, 0).value
            if target is None:
                return None
            fill_value = self._fill_value(node)
            value = None
            if len(target) == 1 and isinstance(target[0], int) and fill_value:
                if target[0] <= MAX_VALUE_ELEMENTS:
                    value = tuple(fill_value[:1] * target[0])
            return [TensorInfo(tuple(target), value)]
        if op == "Range":
            start, limit, delta = (self._in(node, i).value for i in range(3))
            if start is None or limit is None or delta is None:
                return [TensorInfo((None,))]
            if start == (0,) and delta == (1,):
                return [TensorInfo((limit[0],))]
            return [TensorInfo((_range_length(start, limit, delta),))]
        return None

    def _slice(self, node: Node, shape: Shape, value: tuple[Dim, ...] | None) -> TensorInfo:
        starts = self._in(node, 1).value
        ends = self._in(node, 2).value
        axes = self._constant_ints(node.inputs[3]) if len(node.inputs) > 3 else None
        steps = self._constant_ints(node.inputs[4]) if len(node.inputs) > 4 else None
        rank = len(shape)
        if starts is None or ends is None:
            # A Slice keeps the rank, and the dims of the axes it does not slice.
            if axes is None:
                return TensorInfo((None,) * rank)
            unknown = {axis % rank for axis in axes if -rank <= axis < rank}
            return TensorInfo(tuple(None if i in unknown else d for i, d in enumerate(shape)))
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
        dims = list(shape)
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
            axis %= rank
            dims[axis] = _slice_length(shape[axis], start, end, step)
        out_value = None
        if value is not None and rank == 1 and all(isinstance(x, int) for x in (*starts, *ends)):
            out_value = tuple(value[slice(starts[0], ends[0], steps[0])])  # type: ignore[misc]
        return TensorInfo(tuple(dims), out_value)

    def _split(self, node: Node, shape: Shape) -> list[TensorInfo] | None:
        rank = len(shape)
        axis = node.attr("axis", 0) % rank
        sizes = node.attr("split")
        if sizes is None and len(node.inputs) > 1 and node.inputs[1]:
            sizes = self._constant_ints(node.inputs[1])
        count = len(node.outputs)
        if sizes is None:
            whole = shape[axis]
            sizes = [whole // count if isinstance(whole, int) else None] * count
        results = []
        for size in sizes:
            dims = list(shape)
            dims[axis] = size
            results.append(TensorInfo(tuple(dims)))
        return results


_ANY_INPUT_RULES: dict[str, Callable[[ShapeInference, Node], list[TensorInfo] | None]] = {
    "Constant": ShapeInference._constant,
    "Range": ShapeInference._generator_rule,
    "ConstantOfShape": ShapeInference._generator_rule,
    "GatherElements": ShapeInference._gather_elements,
    "Einsum": ShapeInference._einsum,
}
_KNOWN_INPUT_RULES: dict[
    str, Callable[[ShapeInference, Node, TensorInfo], list[TensorInfo] | None]
] = {
    "Shape": ShapeInference._shape_op,
    "Size": ShapeInference._size,
    "Transpose": ShapeInference._transpose,
    "Reshape": ShapeInference._reshape,
    "Unsqueeze": ShapeInference._unsqueeze,
    "Squeeze": ShapeInference._unsqueeze,
    "Gather": ShapeInference._gather,
    "Concat": ShapeInference._concat,
    "Slice": ShapeInference._slice_rule,
    "Split": ShapeInference._split_rule,
    "MatMul": ShapeInference._matmul_rule,
    "MatMulInteger": ShapeInference._matmul_rule,
    "FusedMatMul": ShapeInference._matmul_rule,
    "Gemm": ShapeInference._gemm,
    "Expand": ShapeInference._expand,
    **dict.fromkeys(
        "ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceL2".split(),
        ShapeInference._reduce,
    ),
    "Flatten": ShapeInference._flatten,
    "Attention": ShapeInference._fused_attention,
    "MultiHeadAttention": ShapeInference._fused_attention,
    "GroupQueryAttention": ShapeInference._fused_attention,
    "Conv": ShapeInference._conv_rule,
    "Tile": ShapeInference._tile,
    "Pad": ShapeInference._pad,
    "EmbedLayerNormalization": ShapeInference._embed_layer_norm,
}
_RULE_OPS = ELEMENTWISE | SAME_SHAPE | _ANY_INPUT_RULES.keys() | _KNOWN_INPUT_RULES.keys()


def _few_integers(data_type: int, shape: Shape) -> bool:
    """Whether a constant of this type and shape is one _ints reads (integers, few of them)."""
    return data_type in INTEGER_TYPES and (
        not all(isinstance(d, int) for d in shape) or math.prod(shape) <= MAX_VALUE_ELEMENTS  # type: ignore[arg-type]
    )


def _is_small(tensor: onnx.TensorProto) -> bool:
    if tensor.data_type not in (protos.TensorProto.INT64, protos.TensorProto.INT32):
        return False
    return math.prod(tensor.dims) <= MAX_VALUE_ELEMENTS


def _raw_ints(tensor: onnx.TensorProto, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    """The values of a short integer vector or scalar stored as raw_data (the usual constant
    of shape arithmetic), read without numpy; None when it is stored otherwise."""
    if tensor.data_type not in INTEGER_TYPES:
        return None
    return raw_values(tensor, dims[0] if dims else 1, whole=True)


def _as_value(value: np.ndarray | None) -> tuple[Dim, ...] | None:
    if value is None or value.dtype.kind not in "iu" or value.ndim > 1:
        return None
    if value.size > MAX_VALUE_ELEMENTS:
        return None
    return tuple(int(v) for v in value.reshape(-1))


def _merge(declared: Shape, inferred: Shape | None) -> Shape:
    if inferred is None or len(inferred) != len(declared):
        return declared
    return tuple(i if d is None else d for d, i in zip(declared, inferred, strict=True))


def _matmul(a: Shape, b: Shape) -> Shape | None:
    if len(a) < 1 or len(b) < 1:
        return None
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    batch = _broadcast([a2[:-2], b2[:-2]]) if len(a2) > 2 or len(b2) > 2 else ()
    out = tuple(batch or ()) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _slice_length(dim: Dim, start: Dim, end: Dim, step: Dim) -> Dim:
    if step == 1 and start == f"-{dim}" and isinstance(end, int) and end >= 2**31 - 1:
        return dim  # x[-n:] of a length n
    if not isinstance(start, int) or not isinstance(step, int):
        return None
    if step == 1 and start == 0 and isinstance(end, str):
        return end  # x[:n] with n a symbol, e.g. a position table cut to the sequence length
    if step == 1 and start == 0 and isinstance(end, int) and end >= 2**31 - 1:
        return dim
    if isinstance(dim, int) and isinstance(end, int):
        return len(range(*slice(start, end, step).indices(dim)))
    if isinstance(dim, str) and "*" not in dim and step == 1 and isinstance(end, int):
        # x[k:] and x[:-k] of a symbolic length (a convolution's padding trimmed, say).
        if end >= 2**31 - 1 and start >= 0:
            return _shifted(dim, -start)
        if start == 0 and end < 0:
            return _shifted(dim, end)
    return None


def _range_length(start: Sequence[Dim], limit: Sequence[Dim], delta: Sequence[Dim]) -> Dim:
    values = (start[0] if start else None, limit[0] if limit else None, delta[0] if delta else None)
    if all(isinstance(v, int) for v in values):
        s, lim, d = values  # type: ignore[misc]
        return max(0, -(-(lim - s) // d))  # type: ignore[operator]
    return None


def _elementwise_value(op: str, values: Sequence[tuple[Dim, ...] | None]) -> tuple[Dim, ...] | None:
    first = values[0]
    if op in ("Cast", "Identity", "CastLike"):
        return first
    if op == "Where":
        return _where_value(*values)
    if op == "Neg":
        return None if first is None else tuple(_negated(dim) for dim in first)
    second = values[1] if len(values) > 1 else None
    if op == "Equal" and first is not None and second is not None:
        return _equal_value(first, second)
    if first is None or second is None or op not in _VALUE_OPS:
        return None
    if len(second) == 1 and len(first) > 1:
        second = second * len(first)
    if len(first) == 1 and len(second) > 1:
        first = first * len(second)
    if len(first) != len(second):
        return None
    result: list[Dim] = []
    for a, b in zip(first, second, strict=True):
        if isinstance(a, int) and isinstance(b, int):
            result.append(_integer_result(op, a, b))
        elif op in ("Mul", "Div") and b == 1:
            result.append(a)
        elif op == "Mul" and a is not None and b is not None:
            result.append(_dim_of(size_of([a, b])))
        elif op == "Div" and isinstance(b, int) and b > 0 and isinstance(a, str):
            result.append(_divide(a, b))
        elif op in ("Add", "Sub") and b == 0:
            result.append(a)
        elif op == "Mul" and a == 1:
            result.append(b)
        else:
            result.append(None)
    return tuple(result)


_VALUE_OPS = frozenset(("Add", "Sub", "Mul", "Div", "Mod", "Max", "Min"))


def _integer_result(op: str, a: int, b: int) -> Dim:
    if op == "Mod":
        # Both of ONNX's Mod (fmod 0 and 1) agree on non-negative operands (TorchScript's
        # nn.MultiheadAttention computes its unflatten's split point with one).
        return a % b if a >= 0 and b > 0 else None
    if op in ("Max", "Min"):
        return max(a, b) if op == "Max" else min(a, b)
    return {"Add": a + b, "Sub": a - b, "Mul": a * b, "Div": a // b if b else 0}[op]


def _negated(dim: Dim) -> Dim:
    """``-dim`` for an integer or a plain symbol (``-sequence``, the start of x[-n:]); None
    for an expression."""
    if isinstance(dim, int):
        return -dim
    if dim is None:
        return None
    negative = dim.startswith("-")
    name = dim[1:] if negative else dim
    if not is_name(name):
        return None
    return name if negative else f"-{name}"


def _align(*values: tuple[Dim, ...]) -> list[tuple[Dim, ...]] | None:
    length = max(len(v) for v in values)
    aligned = []
    for value in values:
        if len(value) == 1 and length > 1:
            value = value * length
        if len(value) != length:
            return None
        aligned.append(value)
    return aligned


def _equal_value(first: tuple[Dim, ...], second: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    aligned = _align(first, second)
    if aligned is None:
        return None
    result: list[Dim] = []
    for a, b in zip(*aligned, strict=True):
        if isinstance(a, int) and isinstance(b, int):
            result.append(int(a == b))
        elif isinstance(a, str) and isinstance(b, int) and b < 0:
            result.append(0)  # a size is never negative
        elif isinstance(b, str) and isinstance(a, int) and a < 0:
            result.append(0)
        else:
            result.append(None)
    return tuple(result)


def _where_value(
    condition: tuple[Dim, ...] | None, yes: tuple[Dim, ...] | None, no: tuple[Dim, ...] | None
) -> tuple[Dim, ...] | None:
    if condition is None or yes is None or no is None:
        return None
    aligned = _align(condition, yes, no)
    if aligned is None or any(not isinstance(c, int) for c in aligned[0]):
        return None
    return tuple(y if c else n for c, y, n in zip(*aligned, strict=True))


def _divide(dim: str, divisor: int) -> Dim:
    """``2*batch`` / 2 -> ``batch``; None when the factor is not there."""
    size = size_of([dim])
    return None if size is None else _dim_of(_quotient(size, (divisor, ())))
