"""Seeded random inputs for onnxruntime runs, of each graph input's declared type and shape.

Feeds (``make_feeds``) are random, seeded, of each input's declared type. An integer input that
indexes an embedding table (it reaches a ``Gather`` of an initializer as the indices, possibly
through Reshape/Cast/Unsqueeze-like ops) stays below the table size; integer or bool inputs
named like masks are all ones (True); other integer inputs are 0 or 1. The dims come from
``sizes.resolve_dims``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import onnx

from shardcheck.errors import InputError
from shardcheck.graph.index import GraphIndex

MASK_LIKE = re.compile(r"mask", re.IGNORECASE)
# Ops that carry indices unchanged (in value) from their first input to their output.
INDEX_CARRYING_OPS = frozenset(
    "Reshape Flatten Unsqueeze Squeeze Cast Identity Expand Transpose Tile Slice".split()
)
FLOAT_TYPES = (np.float16, np.float32, np.float64)


def make_feeds(index: GraphIndex, dims: Mapping[str, int], seed: int) -> dict[str, np.ndarray]:
    """Seeded random inputs for every graph input (rules in the module docstring)."""
    if seed < 0:
        raise InputError(f"--seed {seed}: expected a non-negative integer")
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for name in index.graph_inputs:
        shape = _concrete_shape(index, name, dims)
        dtype = _numpy_dtype(index, name)
        feeds[name] = _random_values(index, name, shape, dtype, rng)
    return feeds


def _concrete_shape(index: GraphIndex, name: str, dims: Mapping[str, int]) -> tuple[int, ...]:
    declared = index.declared_shape(name)
    if declared is None:
        raise InputError(f"{index.source}: input {name!r} declares no shape; cannot make a feed")
    shape: list[int] = []
    for axis, dim in enumerate(declared):
        if isinstance(dim, int):
            if dim < 0:
                raise InputError(
                    f"{index.source}: input {name!r}: axis {axis} has the negative size {dim}; "
                    "cannot make a feed"
                )
            shape.append(dim)
        elif isinstance(dim, str):
            if dim not in dims:
                raise InputError(
                    f"{index.source}: input {name!r}: no value for dim {dim!r}; "
                    f"pass --dim {dim}=VALUE"
                )
            shape.append(dims[dim])
        else:
            raise InputError(
                f"{index.source}: input {name!r}: axis {axis} has neither a size nor a name; "
                "cannot make a feed"
            )
    return tuple(shape)


def _numpy_dtype(index: GraphIndex, name: str) -> np.dtype:
    elem_type = index.elem_type(name)
    if elem_type is None:
        raise InputError(f"{index.source}: input {name!r} declares no element type")
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    if dtype == np.bool_ or np.issubdtype(dtype, np.integer) or dtype in FLOAT_TYPES:
        return dtype
    type_name = onnx.TensorProto.DataType.Name(elem_type)
    raise InputError(f"{index.source}: input {name!r}: type {type_name} is not supported for feeds")


def _random_values(
    index: GraphIndex,
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    rng: np.random.Generator,
) -> np.ndarray:
    if dtype in FLOAT_TYPES:
        return rng.standard_normal(shape).astype(dtype)
    if MASK_LIKE.search(name):
        return np.ones(shape, dtype=dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    table = embedding_table_size(index, name)
    high = table if table is not None else 2
    return rng.integers(0, high, size=shape).astype(dtype)


def embedding_table_size(index: GraphIndex, name: str) -> int | None:
    """The smallest table an integer input indexes (as Gather indices of an initializer)."""
    sizes: list[int] = []
    seen: set[str] = set()
    stack = [name]
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        for node in index.consumers_of(tensor):
            if node.op_type == "Gather" and node.inputs[1] == tensor:
                table = index.initializers.get(node.inputs[0])
                if table is not None and table.dims:
                    axis = int(node.attr("axis", 0)) % len(table.dims)
                    sizes.append(int(table.dims[axis]))
            elif node.op_type in INDEX_CARRYING_OPS and node.inputs[0] == tensor:
                stack.append(node.outputs[0])
    return min(sizes) if sizes else None
