"""A model's external weights in one copy: each weight file mapped once, read-only, for every
onnxruntime session and every value the simulation feeds. A model's large inline weights are
external weights of its own file by then (graph/inline_weights.py): they are lent the same way.

Left to itself, each onnxruntime session maps (or reads) the external data it needs: verify's
single-device session and every stage session of the simulation would each hold the weights
again, and a process's resident size counts a page once per mapping that touched it. Instead
the weights are handed to each session with ``SessionOptions.add_initializer``, over one
mapping of their file: onnxruntime then uses the caller's memory as it is
(``add_external_initializers`` would copy it, docs/performance.md).

A file is mapped only after its size has been checked, on the open file, against every tensor
that is read from it (graph/mapped_files.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from shardcheck.graph.mapped_files import mapped

if TYPE_CHECKING:
    import onnxruntime


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def numpy_dtype(data_type: int) -> np.dtype[Any] | None:
    """The numpy dtype of an ONNX element type, when it is a number numpy computes with."""
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, TypeError, ValueError):
        return None
    return dtype if dtype.kind in "biufc" else None


def external_weight(
    tensor: onnx.TensorProto, weights_dir: Path | None, source: str = "<model>"
) -> np.ndarray | None:
    """The value of the external tensor ``tensor``, a read-only view of its file's one mapping;
    None when it cannot be one (no directory, a type numpy has no dtype of, a length that is
    not its dims' size): onnxruntime reads those itself. An offset need not be aligned to the
    type: numpy and onnxruntime's CPU kernels read unaligned values.
    A file too short for it is refused (InputError, ``source`` names the model)."""
    if weights_dir is None:
        return None
    entries = {entry.key: entry.value for entry in tensor.external_data}
    dtype = numpy_dtype(tensor.data_type)
    if dtype is None:
        return None
    try:
        offset = int(entries.get("offset") or 0)
        nbytes = math.prod(int(d) for d in tensor.dims) * dtype.itemsize
        length = int(entries.get("length") or nbytes)
    except ValueError:
        return None
    if length != nbytes or offset < 0:
        return None
    if nbytes == 0:
        return np.zeros(tuple(tensor.dims), dtype)
    location = entries.get("location", "")
    whole = mapped(weights_dir / location, offset + nbytes, tensor.name, source)
    view = np.frombuffer(whole, np.uint8, nbytes, offset)
    return view.view(dtype).reshape(tuple(tensor.dims))


def shared_initializers(
    tensors: Iterable[onnx.TensorProto], weights_dir: Path | None, source: str = "<model>"
) -> dict[str, onnxruntime.OrtValue]:
    """onnxruntime values over the one mapping of each external tensor of ``tensors`` that can
    be mapped (``external_weight``), by name, for ``SessionOptions.add_initializer``."""
    import onnxruntime

    values: dict[str, Any] = {}
    for tensor in tensors:
        if is_external(tensor):
            value = external_weight(tensor, weights_dir, source)
            if value is not None:
                values[tensor.name] = onnxruntime.OrtValue.ortvalue_from_numpy(value)
    return values
