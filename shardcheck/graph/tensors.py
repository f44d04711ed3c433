"""Tensors of an ONNX model read without onnx's helpers: small raw values, and the walks over
every tensor of the graphs, subgraphs and functions (to find the external-data files)."""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shardcheck.graph import protos
from shardcheck.graph.protos import full_onnx

if TYPE_CHECKING:
    import numpy as np
    import onnx

_LITTLE_ENDIAN = sys.byteorder == "little"

_EXTERNAL = protos.TensorProto.EXTERNAL
_TENSOR = protos.AttributeProto.TENSOR
_TENSORS = protos.AttributeProto.TENSORS
_GRAPH = protos.AttributeProto.GRAPH
_GRAPHS = protos.AttributeProto.GRAPHS
_STRUCT_CODES = {
    protos.TensorProto.FLOAT: "f",
    protos.TensorProto.DOUBLE: "d",
    protos.TensorProto.FLOAT16: "e",
    protos.TensorProto.INT64: "q",
    protos.TensorProto.INT32: "i",
    protos.TensorProto.INT16: "h",
    protos.TensorProto.INT8: "b",
    protos.TensorProto.UINT64: "Q",
    protos.TensorProto.UINT32: "I",
    protos.TensorProto.UINT16: "H",
    protos.TensorProto.UINT8: "B",
    protos.TensorProto.BOOL: "?",
}
_LAYOUTS: dict[tuple[int, str], struct.Struct] = {}  # (count, code) -> its little-endian layout
# The field that holds a tensor's values where they are not raw_data, by element type: the
# types whose field holds the values themselves (onnx.proto: int32_data holds the narrower
# integers one value per entry; float16's entries are its bits, so it is read from raw_data).
_VALUE_FIELDS = {
    protos.TensorProto.FLOAT: "float_data",
    protos.TensorProto.DOUBLE: "double_data",
    protos.TensorProto.INT64: "int64_data",
    protos.TensorProto.INT32: "int32_data",
    protos.TensorProto.INT16: "int32_data",
    protos.TensorProto.INT8: "int32_data",
    protos.TensorProto.UINT16: "int32_data",
    protos.TensorProto.UINT8: "int32_data",
    protos.TensorProto.UINT32: "uint64_data",
    protos.TensorProto.UINT64: "uint64_data",
}
INTEGER_TYPES = frozenset(code for code, letter in _STRUCT_CODES.items() if letter in "bhiqBHIQ")


@functools.cache
def _raw_dtypes() -> dict[int, np.dtype[Any]]:
    """Element types whose raw_data numpy reads as is (little-endian hosts); others go through
    onnx.numpy_helper.to_array, which gives the same arrays more slowly. numpy is imported
    here, when a constant's value is first read: most graphs never need one."""
    import numpy as np

    tensor = protos.TensorProto
    return {
        tensor.FLOAT: np.dtype(np.float32),
        tensor.DOUBLE: np.dtype(np.float64),
        tensor.FLOAT16: np.dtype(np.float16),
        tensor.INT64: np.dtype(np.int64),
        tensor.INT32: np.dtype(np.int32),
        tensor.INT16: np.dtype(np.int16),
        tensor.INT8: np.dtype(np.int8),
        tensor.UINT64: np.dtype(np.uint64),
        tensor.UINT32: np.dtype(np.uint32),
        tensor.UINT16: np.dtype(np.uint16),
        tensor.UINT8: np.dtype(np.uint8),
        tensor.BOOL: np.dtype(np.bool_),
    }


def raw_values(
    tensor: onnx.TensorProto,
    count: int,
    *,
    whole: bool = False,
    raw: bytes | memoryview | None = None,
) -> tuple[Any, ...] | None:
    """The first ``count`` values of an inline tensor stored as little-endian raw_data, read
    with struct (no numpy, nor the rest of the data); with ``whole``, only when the tensor
    holds exactly ``count``. None when it is stored otherwise. ``raw``: the tensor's data
    bytes, where they are not in the proto (GraphIndex.raw_values)."""
    code = _STRUCT_CODES.get(tensor.data_type)
    if code is None or not _LITTLE_ENDIAN:
        return None
    if raw is None:
        if tensor.data_location == _EXTERNAL or not tensor.HasField("raw_data"):
            return None
        raw = tensor.raw_data
    layout = _LAYOUTS.get((count, code))
    if layout is None:
        layout = _LAYOUTS[count, code] = struct.Struct(f"<{count}{code}")
    if len(raw) < layout.size or (whole and len(raw) != layout.size):
        return None
    return layout.unpack_from(raw)


def field_values(tensor: onnx.TensorProto) -> tuple[Any, ...]:
    """The values a tensor holds in the typed field of its element type, not as raw_data (as
    onnx.helper.make_tensor and graph/build.py store them); () for a type without one."""
    field = _VALUE_FIELDS.get(tensor.data_type)
    return () if field is None or tensor.HasField("raw_data") else tuple(getattr(tensor, field))


def tensor_value(tensor: onnx.TensorProto) -> np.ndarray:
    """``numpy_helper.to_array`` of an inline tensor, reading raw_data directly when it can."""
    import numpy as np

    dtype = _raw_dtypes().get(tensor.data_type)
    if (
        dtype is not None
        and _LITTLE_ENDIAN
        and tensor.HasField("raw_data")
        and not tensor.HasField("segment")
    ):
        return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(tensor.dims[:])
    return full_onnx().numpy_helper.to_array(tensor)


def sparse_as_dense(sparse: onnx.SparseTensorProto) -> onnx.TensorProto | None:
    """A sparse tensor as the dense one it stands for; None when its values are external."""
    if sparse.values.data_location == _EXTERNAL:
        return None
    import numpy as np

    dims = [int(d) for d in sparse.dims]
    values = tensor_value(sparse.values).reshape(-1)
    indices = tensor_value(sparse.indices)
    if indices.ndim == 2:  # one row of coordinates per value, else positions in the flat tensor
        indices = np.ravel_multi_index(tuple(indices.T), dims)
    flat = np.zeros(int(np.prod(dims)), dtype=values.dtype)
    flat[indices.reshape(-1)] = values
    return full_onnx().numpy_helper.from_array(flat.reshape(dims), sparse.values.name)


def external_locations(model: onnx.ModelProto) -> set[str]:
    """The files that hold the model's external tensors (locations relative to the model):
    those of its main graph, its subgraphs (If, Loop, Scan bodies) and its functions."""
    return locations_of(external_tensors(model))


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [tensor for tensor in model_tensors(model) if tensor.data_location == _EXTERNAL]


def model_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of the model's graphs and functions, in a fixed order."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        yield from node_tensors(function.node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    yield from node_tensors(graph.node)


def node_tensors(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    """The tensors in the attributes of ``nodes``, their subgraphs' included."""
    for node in nodes:
        for attribute in node.attribute:
            yield from attribute_tensors(attribute)


def attribute_tensors(attribute: onnx.AttributeProto) -> Iterator[onnx.TensorProto]:
    kind = attribute.type
    if kind == _TENSOR:
        yield attribute.t
    elif kind == _TENSORS:
        yield from attribute.tensors
    else:
        for graph in attribute_graphs(attribute):
            yield from _graph_tensors(graph)


def attribute_graphs(attribute: onnx.AttributeProto) -> Sequence[onnx.GraphProto]:
    """The subgraphs an attribute holds (If's branches, Loop's and Scan's bodies)."""
    kind = attribute.type
    if kind == _GRAPH:
        return (attribute.g,)
    if kind == _GRAPHS:
        return attribute.graphs
    return ()


def locations_of(tensors: Iterable[onnx.TensorProto]) -> set[str]:
    """The files that external ``tensors`` name in their ``location`` entries."""
    return {
        entry.value
        for tensor in tensors
        for entry in tensor.external_data
        if entry.key == "location"
    }
