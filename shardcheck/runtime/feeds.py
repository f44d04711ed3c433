"""Seeded random inputs for onnxruntime runs, of each graph input's declared type and shape.

Feeds (``make_feeds``) are random, seeded, of each input's declared type. An integer input that
indexes an embedding table (it reaches a ``Gather`` of an initializer as the indices, possibly
through Reshape/Cast/Unsqueeze-like ops) stays below the table size; other integer inputs are
0 or 1. The dims come from ``sizes.resolve_dims``.

The inputs a tokenizer makes are made as it would, so that hints that cut or drop them show:

- An integer or bool input named like a mask is a padding mask, ones (True) where a token is.
  With a batch of 2 or more (its first axis a batch dim), every odd row is padded on the right:
  its last ``padded_positions(S)`` positions along its last axis are zeros, an odd count of
  about a third of the row (and never the whole row), so that neither the padding nor the
  tokens divide evenly among an even number of ranks. Even rows, and a batch of 1, are all
  ones.
- An integer input named like position ids counts 0 to S-1 along its last axis in every row,
  as a tokenizer's right padding leaves them (below the position table, when it indexes one).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import onnx

from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.errors import InputError
from shardcheck.graph.index import GraphIndex

MASK_LIKE = re.compile(r"mask", re.IGNORECASE)
POSITION_IDS_LIKE = re.compile(r"position|pos_ids", re.IGNORECASE)
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
        return padding_mask(shape, dtype, batched=_batched(index, name))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    table = embedding_table_size(index, name)
    if POSITION_IDS_LIKE.search(name) and shape:
        positions = np.arange(shape[-1]) if table is None else np.arange(shape[-1]) % table
        return np.broadcast_to(positions, shape).astype(dtype)
    high = table if table is not None else 2
    return rng.integers(0, high, size=shape).astype(dtype)


def padded_positions(length: int) -> int:
    """How many positions a padded row of ``length`` ends in zeros: odd, about a third of
    the row, at least one position left a token (none padded when the row has only one)."""
    return min((length // 3) | 1, length - 1)


def padding_mask(shape: tuple[int, ...], dtype: np.dtype, *, batched: bool) -> np.ndarray:
    """Ones, with every odd row along the first axis padded on the right when ``batched``
    (rules in the module docstring)."""
    mask = np.ones(shape, dtype=dtype)
    if batched and len(shape) >= 2 and shape[-1] > 0:
        padded = padded_positions(shape[-1])
        if padded > 0:
            mask[1::2, ..., shape[-1] - padded :] = 0
    return mask


def _batched(index: GraphIndex, name: str) -> bool:
    """Whether the input's first axis is a batch dim (named like one)."""
    declared = index.declared_shape(name)
    return bool(declared) and isinstance(declared[0], str) and bool(BATCH_LIKE.search(declared[0]))


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
