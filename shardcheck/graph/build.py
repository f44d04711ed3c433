"""Nodes, attributes, small tensors and value infos, built with the message classes of
graph/protos.py.

``onnx.helper`` builds the same messages, but importing it imports the whole ``onnx`` package
and ml_dtypes with it, which costs gen more than weighing the extension itself. The multi-device
models that gen counts are built from these instead, so gen imports neither. The fields are set
as ``onnx.helper`` sets them (attributes sorted by name, a string attribute's value as UTF-8, an
empty name left unset), so the models are the same messages, byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardcheck.graph.ops import is_default_domain
from shardcheck.graph.protos import (
    AttributeProto,
    ModelProto,
    NodeProto,
    TensorProto,
    ValueInfoProto,
)

AttributeValue = int | float | str | bytes | TensorProto | Sequence[int]


def make_node(
    op_type: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str | None = None,
    domain: str | None = None,
    **attributes: AttributeValue | None,
) -> NodeProto:
    """A node of ``op_type`` with ``attributes`` in the order of their names (those given
    None left out)."""
    node = NodeProto()
    node.op_type = op_type
    node.input.extend(inputs)
    node.output.extend(outputs)
    if name:
        node.name = name
    if domain is not None:
        node.domain = domain
    node.attribute.extend(
        make_attribute(key, value) for key, value in sorted(attributes.items()) if value is not None
    )
    return node


def make_attribute(name: str, value: AttributeValue) -> AttributeProto:
    """An attribute of the type ``value`` has: INT, FLOAT, STRING, TENSOR, or INTS for a
    sequence (of integers; an empty one too)."""
    attribute = AttributeProto()
    attribute.name = name
    if isinstance(value, bool | int):
        attribute.i = int(value)
        attribute.type = AttributeProto.INT
    elif isinstance(value, float):
        attribute.f = value
        attribute.type = AttributeProto.FLOAT
    elif isinstance(value, str | bytes):
        attribute.s = value.encode() if isinstance(value, str) else value
        attribute.type = AttributeProto.STRING
    elif isinstance(value, TensorProto):
        attribute.t.CopyFrom(value)
        attribute.type = AttributeProto.TENSOR
    else:
        attribute.ints.extend(int(item) for item in value)
        attribute.type = AttributeProto.INTS
    return attribute


def int64_tensor(name: str, dims: Sequence[int], values: Sequence[int]) -> TensorProto:
    """An INT64 tensor with its values in ``int64_data``."""
    tensor = TensorProto()
    tensor.data_type = TensorProto.INT64
    tensor.name = name
    tensor.dims.extend(dims)
    tensor.int64_data.extend(values)
    return tensor


# The first opset whose Shape takes ``start`` and ``end``.
SHAPE_BOUNDS_OPSET = 15


def onnx_opset(model: ModelProto) -> int:
    """The version of the ONNX operator set ``model`` imports (the newest, where a model
    lists it twice)."""
    versions = [entry.version for entry in model.opset_import if is_default_domain(entry.domain)]
    return max(versions, default=SHAPE_BOUNDS_OPSET)


def dim_nodes(tensor: str, axis: int, output: str, name: str, opset: int) -> list[NodeProto]:
    """The nodes that compute ``tensor``'s dim ``axis`` as the 1-D ``output``: a Shape of that
    entry alone, or before opset 15 (TorchScript exports at opset 14), a Shape and a Gather of
    it."""
    if opset >= SHAPE_BOUNDS_OPSET:
        return [make_node("Shape", [tensor], [output], name=name, start=axis, end=axis + 1)]
    shape, entry = f"{output}/shape", f"{output}/axis"
    return [
        make_node("Shape", [tensor], [shape], name=f"{name}/shape"),
        make_node("Constant", [], [entry], name=entry, value=int64_tensor(entry, [1], [axis])),
        make_node("Gather", [shape, entry], [output], name=name, axis=0),
    ]


def tensor_value_info(name: str, elem_type: int) -> ValueInfoProto:
    """The value info of a tensor of ``elem_type`` whose shape is not given."""
    info = ValueInfoProto()
    info.name = name
    info.type.tensor_type.elem_type = elem_type
    return info
