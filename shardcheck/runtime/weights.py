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
from collections.abc import Iterable
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


def external_weight(
    tensor: onnx.TensorProto, weights_dir: Path | None, source: str = "<model>"
) -> np.ndarray | None:
    """The value of the external tensor ``tensor``, a read-only view of its file's one mapping;
    None when it cannot be one (no directory, a type numpy has no dtype of, a length that is
    not its dims' size, an offset not aligned to its type): onnxruntime reads those itself.
    A file too short for it is refused (InputError, ``source`` names the model)."""
    if weights_dir is None:
        return None
    entries = {entry.key: entry.value for entry in tensor.external_data}
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        offset = int(entries.get("offset") or 0)
        nbytes = math.prod(int(d) for d in tensor.dims) * dtype.itemsize
        length = int(entries.get("length") or nbytes)
    except (KeyError, TypeError, ValueError):
        return None
    if dtype.kind not in "biufc" or length != nbytes or offset < 0 or offset % dtype.itemsize:
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
