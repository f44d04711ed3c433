"""What shape inference knows of one tensor (TensorInfo), and the small integer values it reads
from constants to fill one in."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from shardcheck.graph.index import Dim, Shape
from shardcheck.graph.tensors import INTEGER_TYPES, field_values, raw_values

if TYPE_CHECKING:
    import numpy as np
    import onnx

# Integer tensors up to this many elements carry their values (shapes, axes, indices).
MAX_VALUE_ELEMENTS = 16


class TensorInfo(NamedTuple):
    shape: Shape | None = None
    # For small integer tensors: scalars and vectors, and the matrices that a Reshape makes
    # of a vector's value (row-major): TorchScript reorders F.pad's pads through a [-1, 2]
    # matrix, reversed along its rows and transposed.
    value: tuple[Dim, ...] | None = None


UNKNOWN = TensorInfo()


def small_ints(value: np.ndarray | None) -> list[int] | None:
    """The elements of a small integer array, flattened; None for any other."""
    if value is None or value.dtype.kind not in "iu" or value.size > MAX_VALUE_ELEMENTS:
        return None
    return [int(v) for v in value.reshape(-1)]


def raw_ints(tensor: onnx.TensorProto, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    """The values of a short integer vector or scalar stored as raw_data (the usual constant
    of shape arithmetic) or in its typed field (as the multi-device model's length constants
    are built), read without numpy; None when it is stored otherwise."""
    if tensor.data_type not in INTEGER_TYPES:
        return None
    count = dims[0] if dims else 1
    in_field = field_values(tensor)
    return in_field if len(in_field) == count else raw_values(tensor, count, whole=True)


def shape_value(value: np.ndarray | None) -> tuple[Dim, ...] | None:
    """A small integer vector or scalar as the value a TensorInfo carries; None for any other."""
    if value is None or value.dtype.kind not in "iu" or value.ndim > 1:
        return None
    if value.size > MAX_VALUE_ELEMENTS:
        return None
    return tuple(int(v) for v in value.reshape(-1))
