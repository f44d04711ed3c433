"""A read-only index of an ONNX graph, built in one pass: producers, consumers, shapes.

Detection, axis inference and the suggestion walks all read this index; none of them copies the
graph. Weights are never needed: initializers are kept as protos and only their dims are read,
except for small constants that a pattern asks for by value.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardcheck.graph import protos
from shardcheck.graph.ops import SHAPE_OPS, is_default_domain
from shardcheck.graph.protos import full_onnx
from shardcheck.graph.tensors import (
    INTEGER_TYPES,
    external_tensors,
    field_values,
    locations_of,
    raw_values,
    tensor_value,
)

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from shardcheck.graph.inline_weights import LentWeights

Dim = int | str | None
Shape = tuple[Dim, ...]

# A constant whose value a pattern asks for is read only when it is this small.
SMALL_CONSTANT_ELEMENTS = 4096

_SIMPLE_ATTRIBUTES = {
    protos.AttributeProto.INT: "i",
    protos.AttributeProto.FLOAT: "f",
    protos.AttributeProto.STRING: "s",
    protos.AttributeProto.TENSOR: "t",
}
_EXTERNAL = protos.TensorProto.EXTERNAL


@dataclass(frozen=True, slots=True)
class Node:
    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    proto: onnx.NodeProto = field(repr=False, compare=False)

    @property
    def label(self) -> str:
        """How messages name this node: its name, or its op and position when unnamed."""
        return self.name or f"<unnamed {self.op_type} #{self.index}>"

    def value_tensor(self) -> onnx.TensorProto | None:
        """A Constant node's ``value`` tensor, as a proto (its data is not read)."""
        for attribute in self.proto.attribute:
            if attribute.name == "value":
                return attribute.t
        return None

    def attr(self, name: str, default: Any = None) -> Any:
        for attribute in self.proto.attribute:
            if attribute.name == name:
                return _attribute_value(attribute)
        return default


_NODE_SETTERS = tuple(
    Node.__dict__[name].__set__
    for name in ("index", "name", "op_type", "domain", "inputs", "outputs", "proto")
)


def _attribute_value(attribute: onnx.AttributeProto) -> Any:
    """``onnx.helper.get_attribute_value``, with a short way for the common kinds."""
    kind = attribute.type
    if not attribute.ref_attr_name:
        if kind == protos.AttributeProto.INTS:
            return attribute.ints[:]
        field_name = _SIMPLE_ATTRIBUTES.get(kind)
        if field_name is not None:
            return getattr(attribute, field_name)
    return full_onnx().helper.get_attribute_value(attribute)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while many small objects are made.

    Building the index, the shapes and the walks allocates a few objects per node; with the
    collector on, its young generation fills every few hundred of them, and the older ones are
    walked again and again (a tenth of gen on a 32k-node graph, a third of the index build).
    Nothing the analysis makes forms a cycle: reference counting frees all of it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _value_info_shape(info: onnx.ValueInfoProto) -> Shape | None:
    tensor_type = info.type.tensor_type
    if not info.type.HasField("tensor_type") or not tensor_type.HasField("shape"):
        return None
    dims: list[Dim] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        elif dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        else:
            dims.append(None)
    return tuple(dims)


class GraphIndex:
    """Producers, consumers and declared shapes of a model's main graph."""

    def __init__(
        self,
        model: onnx.ModelProto,
        source: str = "<model>",
        *,
        external_tensors: Callable[[], list[onnx.TensorProto]] | None = None,
        lent_weights: LentWeights | None = None,
        undeclared: Collection[str] = frozenset(),
    ) -> None:
        """``undeclared``: tensors whose value_info is left out (a multi-device model declares
        one device's shapes, which do not hold on a rank for what a scatter reaches)."""
        self.model = model
        self.source = source
        # The large inline weights the model marks external, left in the model file's mapping
        # (inline_weights.py): None when the loader left none there.
        self.lent_weights = lent_weights
        # How the loader finds (or has found) the external tensors of the model, if it does.
        self._find_external_tensors = external_tensors
        self._external_tensors: list[onnx.TensorProto] | None = None
        # The model-local functions inlined into this graph (sharding/inlined.py), as
        # (domain, name): an extension's hints name tensors of the graph they leave.
        self.inlined_functions: tuple[tuple[str, str], ...] = ()
        graph = model.graph
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in graph.initializer}
        self.graph_inputs: list[str] = [
            i.name for i in graph.input if i.name not in self.initializers
        ]
        self.graph_outputs: list[str] = [o.name for o in graph.output]
        self.input_infos = {i.name: i for i in graph.input}
        self.output_infos = {o.name: o for o in graph.output}
        self.value_infos: dict[str, list[onnx.ValueInfoProto]] = {}
        for info in graph.value_info:
            if info.name not in undeclared:
                self.value_infos.setdefault(info.name, []).append(info)

        self.nodes: list[Node] = []
        self.producer: dict[str, int] = {}
        # One entry per use: a node reading a tensor twice is listed twice (as graphsurgeon does).
        self.consumers: dict[str, list[int]] = {}
        with gc_paused():
            self._index_nodes(graph)
        self._constant_cache: dict[str, np.ndarray | None] = {}

    def _index_nodes(self, graph: onnx.GraphProto) -> None:
        # The hot loop of the index (tens of thousands of nodes): Node objects are made without
        # the dataclass __init__ (a frozen one sets each field through object.__setattr__): their
        # slots are filled through the slot descriptors. Repeated fields are read as slices, the
        # fastest way out of upb.
        nodes = self.nodes
        producer = self.producer
        consumers = self.consumers
        new_node = object.__new__
        set_index, set_name, set_op, set_domain, set_inputs, set_outputs, set_proto = _NODE_SETTERS
        for index, proto in enumerate(graph.node):
            inputs = tuple(proto.input[:])
            outputs = tuple(proto.output[:])
            node = new_node(Node)
            set_index(node, index)
            set_name(node, proto.name)
            set_op(node, proto.op_type)
            set_domain(node, proto.domain)
            set_inputs(node, inputs)
            set_outputs(node, outputs)
            set_proto(node, proto)
            nodes.append(node)
            for name in inputs:
                if name:
                    users = consumers.get(name)
                    if users is None:
                        consumers[name] = [index]
                    else:
                        users.append(index)
            for name in outputs:
                if name:
                    producer[name] = index

    def external_tensors(self) -> list[onnx.TensorProto]:
        """The model's tensors whose data is in external files (see ``model_tensors``)."""
        if self._external_tensors is None:
            find = self._find_external_tensors
            self._external_tensors = find() if find else external_tensors(self.model)
        return self._external_tensors

    def external_locations(self) -> set[str]:
        """The files that hold the model's external tensors (locations relative to it)."""
        return locations_of(self.external_tensors())

    # ------------------------------------------------------------------ topology

    def producer_of(self, tensor: str) -> Node | None:
        index = self.producer.get(tensor)
        return None if index is None else self.nodes[index]

    def consumers_of(self, tensor: str) -> list[Node]:
        return [self.nodes[i] for i in self.consumers.get(tensor, ())]

    def read_for_shape(self, node: Node) -> bool:
        """Whether only Shapes read what ``node`` computes: its values go nowhere, its shape
        does, as a length read does (TorchScript's index_add_ reads the Shape of a row it
        Slices off the sum of the experts' outputs)."""
        readers = [reader for output in node.outputs for reader in self.consumers_of(output)]
        return bool(readers) and all(reader.op_type in SHAPE_OPS for reader in readers)

    def computed_from(
        self,
        starts: Iterable[str],
        *,
        stop: Collection[str] = frozenset(),
        ends: Collection[str] = frozenset(),
        through_shapes: bool = True,
    ) -> set[str]:
        """Every tensor computed from ``starts`` (they included): through Shape and Size only
        with ``through_shapes``, not passing the tensors in ``stop``, and not going on past
        those in ``ends`` (a start does go on)."""
        queue = deque(starts)
        first = set(queue)
        found = set(first)
        while queue:
            tensor = queue.popleft()
            if tensor in ends and tensor not in first:
                continue
            for node_index in self.consumers.get(tensor, ()):
                node = self.nodes[node_index]
                if not through_shapes and node.op_type in SHAPE_OPS:
                    continue
                for output in node.outputs:
                    if output and output not in found and output not in stop:
                        found.add(output)
                        queue.append(output)
        return found

    def is_graph_output(self, tensor: str) -> bool:
        return tensor in self.output_infos

    def has_tensor(self, tensor: str) -> bool:
        return tensor in self.producer or tensor in self.input_infos or tensor in self.initializers

    def all_tensor_names(self) -> Iterator[str]:
        yield from self.input_infos
        yield from self.initializers
        for node in self.nodes:
            yield from (name for name in node.outputs if name)

    # ------------------------------------------------------------------ shapes

    def declared_shape(self, tensor: str) -> Shape | None:
        """The shape as onnx-graphsurgeon's importer records it (Polygraphy reads this).

        Initializers win; then value_info (a later duplicate fills in a missing shape); then the
        graph input or output declaration.
        """
        if tensor in self.initializers:
            return tuple(int(d) for d in self.initializers[tensor].dims)
        shape: Shape | None = None
        infos = self.value_infos.get(tensor)
        if infos:
            for info in infos:
                shape = shape or _value_info_shape(info)
            return shape
        if tensor in self.input_infos:
            return _value_info_shape(self.input_infos[tensor])
        if tensor in self.output_infos:
            return _value_info_shape(self.output_infos[tensor])
        return None

    def rank(self, tensor: str) -> int | None:
        shape = self.declared_shape(tensor)
        return None if shape is None else len(shape)

    def elem_type(self, tensor: str) -> int | None:
        initializer = self.initializers.get(tensor)
        if initializer is not None:
            return initializer.data_type
        infos: Sequence[onnx.ValueInfoProto] = self.value_infos.get(tensor, ())
        if tensor in self.input_infos:
            infos = [*infos, self.input_infos[tensor]]
        if tensor in self.output_infos:
            infos = [*infos, self.output_infos[tensor]]
        for info in infos:
            if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
                return info.type.tensor_type.elem_type
        return None

    # ------------------------------------------------------------------ constants

    def constant_tensor(self, tensor: str) -> onnx.TensorProto | None:
        """An initializer, or a Constant node's ``value`` tensor, as a proto (its data is not
        read); None for anything else."""
        proto: onnx.TensorProto | None = self.initializers.get(tensor)
        if proto is None:
            node = self.producer_of(tensor)
            if node is not None and node.op_type == "Constant":
                proto = node.value_tensor()
        return proto

    def constant_value(self, tensor: str) -> np.ndarray | None:
        """The value of a small constant (initializer or Constant node), or None."""
        if tensor in self._constant_cache:
            return self._constant_cache[tensor]
        source = self._constant_source(tensor)
        value = None
        if isinstance(source, protos.TensorProto):
            value = tensor_value(source)
        elif source is not None:
            import numpy as np

            value = np.array(full_onnx().helper.get_attribute_value(source))
        self._constant_cache[tensor] = value
        return value

    def scalar_constant(self, tensor: str) -> float | int | None:
        """The number a one-element constant holds (an inline initializer or a Constant node's
        value), read without numpy; None for anything else."""
        source = self._constant_source(tensor)
        values: tuple[Any, ...] | None = None
        if isinstance(source, protos.AttributeProto):
            single = {"value_float": (source.f,), "value_int": (source.i,)}.get(source.name)
            values = single or tuple(source.floats) or tuple(source.ints)
        elif source is not None and math.prod(source.dims) == 1:
            values = self.raw_values(source, 1, whole=True)
            if values is None:  # stored in the typed field of its type, not as raw_data
                values = field_values(source)
        if values is None or len(values) != 1:
            return None
        return values[0]

    def raw_values(
        self, proto: onnx.TensorProto, count: int, *, whole: bool = False
    ) -> tuple[Any, ...] | None:
        """``tensors.raw_values`` of one of the model's tensors, a large inline weight read
        where it lies in the model file."""
        lent = self.lent_weights
        if lent is not None and lent.lends(proto):
            return raw_values(proto, count, whole=whole, raw=lent.data(proto.name, self.source))
        return raw_values(proto, count, whole=whole)

    def constant_ndim(self, tensor: str) -> int | None:
        """``constant_value(tensor).ndim``, or None where that is None, without reading data."""
        source = self._constant_source(tensor)
        if source is None:
            return None
        if isinstance(source, protos.TensorProto):
            return len(source.dims)
        return 1 if source.name in ("value_floats", "value_ints") else 0

    def constant_ints(self, tensor: str) -> tuple[int, ...] | None:
        """The elements of an integer ``constant_value(tensor)``, flattened (None for other
        element types); stored as raw_data (the usual axes, repeats and indices) or in their
        typed field, they are read without numpy."""
        source = self._constant_source(tensor)
        if source is None:
            return None
        if isinstance(source, protos.TensorProto):
            if source.data_type not in INTEGER_TYPES:
                return None
            count = math.prod(source.dims)
            values = raw_values(source, count, whole=True)
            if values is not None:
                return values
            in_field = field_values(source)
            if len(in_field) == count:
                return in_field
        elif source.name not in ("value_int", "value_ints"):
            return None
        value = self.constant_value(tensor)
        return None if value is None else tuple(int(v) for v in value.reshape(-1))

    def axes_of(self, node: Node) -> list[int] | None:
        """The ``axes`` of an op that takes them as an attribute or, in newer opsets, as a
        constant second input (Unsqueeze, Squeeze, the reductions); None where neither says."""
        axes = node.attr("axes")
        if axes is None and len(node.inputs) > 1 and node.inputs[1]:
            value = self.constant_ints(node.inputs[1])
            axes = None if value is None else list(value)
        return axes

    def _constant_source(self, tensor: str) -> onnx.TensorProto | onnx.AttributeProto | None:
        """Where a small constant's value is stored: an inline tensor (an initializer of at most
        SMALL_CONSTANT_ELEMENTS, or a Constant node's ``value``), or a Constant node's
        ``value_float(s)``/``value_int(s)`` attribute; None for anything else."""
        proto: onnx.TensorProto | None = self.initializers.get(tensor)
        if proto is not None:
            if proto.data_location == _EXTERNAL:
                return None
            return None if math.prod(proto.dims) > SMALL_CONSTANT_ELEMENTS else proto
        node = self.producer_of(tensor)
        if node is None or node.op_type != "Constant" or not is_default_domain(node.domain):
            return None
        for attribute in node.proto.attribute:
            if attribute.name == "value":
                return None if attribute.t.data_location == _EXTERNAL else attribute.t
            if attribute.name in ("value_float", "value_int", "value_floats", "value_ints"):
                return attribute
        return None
