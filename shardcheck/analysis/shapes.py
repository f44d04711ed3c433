"""Symbolic shapes, propagated forward through the graph in one pass.

Each tensor gets a shape whose dims are ints, symbols (the dim_param names of graph inputs, such
as ``sequence``) or None when unknown. Small integer tensors that hold shapes (``Shape`` ->
``Gather`` -> ``Concat`` -> ``Reshape``, as TorchScript writes them) carry their values as dims
too, so a ``Reshape`` whose target is computed from ``Shape(x)`` keeps the symbols of ``x``.

Only what axis inference needs is modelled; an op not covered by a rule (``shape_rules``) gives
unknown shapes, and the analysis downstream treats unknown as "cannot follow", never as a guess.
Declared shapes (value_info, as the dynamo exporter writes for every tensor) are used where
propagation knows less. This module runs the rules over the graph, once per distinct node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from shardcheck.analysis.shape_rules import NODE_NAMED_RULE_OPS, RULE_OPS, apply_rule
from shardcheck.analysis.tensor_info import (
    MAX_VALUE_ELEMENTS,
    UNKNOWN,
    TensorInfo,
    raw_ints,
    shape_value,
    small_ints,
)
from shardcheck.graph import protos
from shardcheck.graph.index import Dim, GraphIndex, Node, Shape
from shardcheck.graph.tensors import INTEGER_TYPES

if TYPE_CHECKING:
    import onnx

# Nodes larger than this, serialized, whose ops take a tensor attribute (a Constant's value) get
# no memo key: serializing a large tensor costs more than the rule.
MAX_MEMO_NODE_BYTES = 512
_TENSOR_ATTRIBUTE_OPS = frozenset(("Constant", "ConstantOfShape"))


# A rule for an op that is not ONNX's (the DistCollective a sharded model holds): it is given
# the inference and the node, as the rules of shape_rules are.
ExtraRule = Callable[["ShapeInference", Node], "list[TensorInfo] | None"]


class ShapeInference:
    """Shapes and small shape values of every tensor of the main graph; ``extra_rules``: rules
    by op type for ops that shape_rules does not know (they get no memo key)."""

    def __init__(
        self, index: GraphIndex, extra_rules: Mapping[str, ExtraRule] | None = None
    ) -> None:
        self.index = index
        self._extra_rules = extra_rules or {}
        self.info: dict[str, TensorInfo] = {}
        for name in index.graph_inputs:
            self.info[name] = TensorInfo(index.declared_shape(name))
        # Constants (initializers, Constant outputs) and those among them whose integer data a
        # rule may read (constant_ints) although their info holds no value.
        self._constants = set(index.initializers)
        self._read_by_name: set[str] = set()
        for name, tensor in index.initializers.items():
            dims = tuple(tensor.dims)
            value = None
            if len(dims) <= 1 and _is_small(tensor):
                value = raw_ints(tensor, dims)
                if value is None:
                    value = shape_value(index.constant_value(name))
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
        # Not kept past the pass: a rule that holds what holds this inference (a bound method
        # of its owner) would make a cycle, which the collector, paused for the analyses,
        # would not free before the exit.
        self._extra_rules = {}

    def shape(self, tensor: str) -> Shape | None:
        info = self.info.get(tensor)
        return None if info is None else info.shape

    def rank(self, tensor: str) -> int | None:
        shape = self.shape(tensor)
        return None if shape is None else len(shape)

    def value(self, tensor: str) -> tuple[Dim, ...] | None:
        info = self.info.get(tensor)
        return None if info is None else info.value

    # ------------------------------------------------------------------ per node

    def _infer(self, node: Node) -> None:
        key = self._memo_key(node)
        known = None if key is None else self._results.get(key)
        if known is None:
            extra = self._extra_rules.get(node.op_type)
            try:
                results = apply_rule(self, node) if extra is None else extra(self, node)
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
            info = results[position] if results and position < len(results) else UNKNOWN
            if info.shape is None or None in info.shape:
                declared = self.index.declared_shape(output)
                if declared is not None:
                    info = TensorInfo(_merge(declared, info.shape), info.value)
            info_of[output] = info

    def _memo_key(self, node: Node) -> tuple[object, ...] | None:
        """What a rule's result depends on: the op, its domain, attributes and number of
        outputs, and each input's info and whether it is a constant (constant_ints reads a
        constant's values from its info). A transformer's layers repeat the same nodes on the
        same shapes: each rule runs once per distinct key. None where the rule has to run: an
        op without a rule, a large tensor attribute (serializing it would cost more than the
        rule), an input whose data the rule may read by name, a rule that names its node."""
        op = node.op_type
        if op not in RULE_OPS or op in NODE_NAMED_RULE_OPS:
            return None
        proto = node.proto
        if op in _TENSOR_ATTRIBUTE_OPS and proto.ByteSize() > MAX_MEMO_NODE_BYTES:
            return None
        if self._read_by_name and not self._read_by_name.isdisjoint(node.inputs):
            return None
        info_get = self.info.get
        constants = self._constants
        inputs = tuple([(info_get(n, UNKNOWN), n in constants) if n else None for n in node.inputs])
        attributes = tuple([attribute.SerializeToString() for attribute in proto.attribute])
        return (op, node.domain, len(node.outputs), attributes, inputs)

    def _read_by_name_after(self, node: Node, results: list[TensorInfo] | None) -> bool:
        """Whether a Constant's output may be a constant whose integer data constant_ints
        reads: its info holds no value, and it may hold few integers (or its rule failed)."""
        if results and results[0].value is not None:
            return False
        tensor = node.value_tensor()
        if tensor is None:  # value_int(s) or value_float(s): few ints are in the info
            return not results
        return _few_integers(tensor.data_type, tuple(tensor.dims))

    # ------------------------------------------------------------------ what the rules read

    def input_info(self, node: Node, position: int) -> TensorInfo:
        """The info of ``node``'s input at ``position`` (unknown for one absent)."""
        inputs = node.inputs
        if position >= len(inputs) or not inputs[position]:
            return UNKNOWN
        return self.info.get(inputs[position], UNKNOWN)

    def constant_ints(self, tensor: str) -> list[int] | None:
        """The values of a small integer constant (initializer or Constant output)."""
        info = self.info.get(tensor)
        # The same test of constness as the memo keys' (_memo_key): they must agree.
        if info is not None and info.value is not None and tensor in self._constants:
            return list(info.value)  # type: ignore[arg-type]
        return small_ints(self.index.constant_value(tensor))


def _few_integers(data_type: int, shape: Shape) -> bool:
    """Whether a constant of this type and shape is one small_ints reads: few integers."""
    return data_type in INTEGER_TYPES and (
        not all(isinstance(d, int) for d in shape) or math.prod(shape) <= MAX_VALUE_ELEMENTS  # type: ignore[arg-type]
    )


def _is_small(tensor: onnx.TensorProto) -> bool:
    if tensor.data_type not in (protos.TensorProto.INT64, protos.TensorProto.INT32):
        return False
    return math.prod(tensor.dims) <= MAX_VALUE_ELEMENTS


def _merge(declared: Shape, inferred: Shape | None) -> Shape:
    if inferred is None or len(inferred) != len(declared):
        return declared
    return tuple(i if d is None else d for d, i in zip(declared, inferred, strict=True))
