"""A model's external weights in one copy: each weight file mapped once, read-only, for every
onnxruntime session and every value the simulation feeds.

Left to itself, each onnxruntime session maps (or reads) the external data it needs: verify's
single-device session and every stage session of the simulation would each hold the weights
again, and a process's resident size counts a page once per mapping that touched it. Instead
the weights are handed to each session with ``SessionOptions.add_initializer``, over one
mapping of their file: onnxruntime then uses the caller's memory as it is
(``add_external_initializers`` would copy it, docs/performance.md).

A file is mapped only after its size has been checked, on the open file, against every tensor
that is read from it: mapping past the end of a file (one truncated after the model was checked)
would kill the process with SIGBUS when the page is touched. A file that shrinks once mapped
still does; nothing short of copying it could prevent that.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from shardcheck.errors import InputError

if TYPE_CHECKING:
    import onnxruntime

# file identity (device, inode, size, modification time) -> its mapping, while anything uses it.
_MAPPINGS: weakref.WeakValueDictionary[tuple[int, int, int, int], mmap.mmap] = (
    weakref.WeakValueDictionary()
)
_LOCK = threading.Lock()


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
    whole = _mapped(weights_dir / location, offset + nbytes, tensor.name, source)
    view = np.frombuffer(whole, np.uint8, nbytes, offset)
    return view.view(dtype).reshape(tuple(tensor.dims))


def _mapped(file: Path, needed: int, tensor: str, source: str) -> mmap.mmap:
    """The one read-only mapping of ``file``, which must hold at least ``needed`` bytes."""
    try:
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise InputError(
            f"{source}: external weight file {file.name!r} of tensor {tensor!r} cannot be "
            f"opened: {error.strerror or error}"
        ) from None
    try:
        status = os.fstat(descriptor)
        if status.st_size < needed:
            raise InputError(
                f"{source}: tensor {tensor!r} needs the first {needed} bytes of {file.name!r}, "
                f"which now has {status.st_size}: the weight file is incomplete (was it cut "
                "short or rewritten while shardcheck ran?)"
            )
        key = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
        with _LOCK:
            mapping = _MAPPINGS.get(key)
            if mapping is None:
                mapping = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
                _MAPPINGS[key] = mapping
        return mapping
    finally:
        os.close(descriptor)


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


# Inline weights at least this large are shared from the model file; smaller ones (shapes,
# scalars) stay in the models handed to onnxruntime.
INLINE_SHARED_BYTES = 1 << 20
# Field numbers of onnx.proto: ModelProto.graph, GraphProto.initializer, TensorProto.name and
# TensorProto.raw_data.
_GRAPH, _INITIALIZER, _NAME, _RAW_DATA = 7, 5, 8, 9


def inline_as_external(model: onnx.ModelProto, model_file: Path) -> dict[str, onnx.TensorProto]:
    """The model's large inline initializers (INLINE_SHARED_BYTES and more, of a numpy type,
    their bytes in ``raw_data``), each as an external tensor whose data is where its bytes lie
    in ``model_file`` itself, by name; {} when there are none. Sessions and fed values then
    share them from the file's one mapping, as external weights; the model is not changed."""
    large = {}
    for tensor in model.graph.initializer:
        dtype = None if is_external(tensor) else numpy_dtype(tensor.data_type)
        if dtype is None or not tensor.HasField("raw_data"):
            continue
        nbytes = math.prod(int(d) for d in tensor.dims) * dtype.itemsize
        if nbytes >= INLINE_SHARED_BYTES:
            large[tensor.name] = (tensor, nbytes)
    if not large:
        return {}
    whole = _mapped(model_file, 0, next(iter(large)), str(model_file))
    external = {}
    for name, (start, end) in _raw_data_spans(memoryview(whole)).items():
        found = large.get(name)
        if found is None or end - start != found[1]:
            continue
        tensor = found[0]
        placeholder = onnx.TensorProto(name=name, data_type=tensor.data_type, dims=tensor.dims)
        placeholder.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (
            ("location", model_file.name),
            ("offset", start),
            ("length", end - start),
        ):
            placeholder.external_data.add(key=key, value=str(value))
        external[name] = placeholder
    return external


def _raw_data_spans(data: memoryview) -> dict[str, tuple[int, int]]:
    """Where each main-graph initializer's ``raw_data`` lies in the serialized model ``data``:
    name -> (start, end), read from the protobuf wire format."""
    spans: dict[str, tuple[int, int]] = {}
    for number, start, end in _fields(data, 0, len(data)):
        if number != _GRAPH:
            continue
        for inner, tensor_start, tensor_end in _fields(data, start, end):
            if inner != _INITIALIZER:
                continue
            name, raw = None, None
            for field, value_start, value_end in _fields(data, tensor_start, tensor_end):
                if field == _NAME:
                    name = bytes(data[value_start:value_end]).decode("utf-8", "replace")
                elif field == _RAW_DATA:
                    raw = (value_start, value_end)  # the last one counts, as for protobuf
            if name is not None and raw is not None:
                spans[name] = raw
    return spans


def _fields(data: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """The length-delimited fields of the message in ``data[start:end]``: (number, start, end);
    the others are skipped."""
    at = start
    while at < end:
        tag, at = _varint(data, at)
        kind = tag & 7
        if kind == 0:
            _, at = _varint(data, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == 2:
            length, at = _varint(data, at)
            if at + length > end:
                raise ValueError("a field runs past its message")
            yield tag >> 3, at, at + length
            at += length
        else:
            raise ValueError(f"protobuf wire type {kind} is not read here")


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def light_model(model: onnx.ModelProto, replaced: Mapping[str, onnx.TensorProto]) -> bytes:
    """``model`` serialized with the initializers named in ``replaced`` replaced (by
    ``inline_as_external``'s tensors), without copying the others' bytes more than once."""
    light = onnx.ModelProto()
    for descriptor, value in model.ListFields():
        if descriptor.name != "graph":
            _copy_field(light, descriptor, value)
    for descriptor, value in model.graph.ListFields():
        if descriptor.name != "initializer":
            _copy_field(light.graph, descriptor, value)
    light.graph.initializer.extend(
        replaced.get(tensor.name, tensor) for tensor in model.graph.initializer
    )
    return light.SerializeToString()


def _copy_field(target: Any, descriptor: Any, value: Any) -> None:
    if descriptor.is_repeated:
        getattr(target, descriptor.name).extend(value)
    elif descriptor.type == descriptor.TYPE_MESSAGE:
        getattr(target, descriptor.name).CopyFrom(value)
    else:
        setattr(target, descriptor.name, value)
