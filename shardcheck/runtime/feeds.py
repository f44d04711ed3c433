"""Inputs for onnxruntime runs: the dims to use, seeded random feeds, a CPU session.

Which value each symbolic dim gets (``resolve_dims``):

1. ``--dim NAME=VALUE`` (``user_dims``) wins;
2. the sequence dims get ``seq_len``. They are the dim names on the hinted sequence axes: the
   declared dim at ``seq_len_idx`` of each hinted graph input, and the symbolic dim that shape
   propagation finds at ``seq_len_idx`` of each hinted inner tensor. When no hinted axis carries
   a name, the sequence dim is the one dim name of the graph inputs the hinted tensors depend on
   that is not batch-like; several candidates are an error that asks for ``--dim``;
3. a batch-like name (``batch``, ``batch_size``, ``bs``, ``N``) gets 1, any other name 2.

Feeds (``make_feeds``) are random, seeded, of each input's declared type. An integer input that
indexes an embedding table (it reaches a ``Gather`` of an initializer as the indices, possibly
through Reshape/Cast/Unsqueeze-like ops) stays below the table size; integer or bool inputs
named like masks are all ones (True); other integer inputs are 0 or 1.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.errors import InputError
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints

if TYPE_CHECKING:
    import onnxruntime

MASK_LIKE = re.compile(r"mask", re.IGNORECASE)
BATCH_DIM_DEFAULT = 1
OTHER_DIM_DEFAULT = 2
# Ops that carry indices unchanged (in value) from their first input to their output.
INDEX_CARRYING_OPS = frozenset(
    "Reshape Flatten Unsqueeze Squeeze Cast Identity Expand Transpose Tile Slice".split()
)
FLOAT_TYPES = (np.float16, np.float32, np.float64)


# --------------------------------------------------------------------------- dims


def resolve_dims(
    index: GraphIndex,
    hints: ShardHints,
    seq_len: int,
    user_dims: Mapping[str, int],
    shapes: ShapeInference | None = None,
) -> dict[str, int]:
    """A value for every symbolic dim of the graph inputs (rules in the module docstring);
    ``shapes``: the model's, when already inferred."""
    names = check_user_dims(index, user_dims)
    sequence = set(sequence_dims(index, hints, user_dims, shapes))
    dims: dict[str, int] = {}
    for name in names:
        if name in user_dims:
            dims[name] = user_dims[name]
        elif name in sequence:
            dims[name] = seq_len
        else:
            dims[name] = BATCH_DIM_DEFAULT if BATCH_LIKE.search(name) else OTHER_DIM_DEFAULT
    return dims


def check_user_dims(index: GraphIndex, user_dims: Mapping[str, int]) -> list[str]:
    """Refuse (InputError) a ``--dim`` the graph inputs do not have, or below 1; the names of
    the inputs' symbolic dims."""
    names = graph_input_dims(index)
    for name, value in user_dims.items():
        if name not in names:
            known = ", ".join(names) or "none"
            raise InputError(
                f"{index.source}: --dim {name}={value}: the model's inputs have no dim "
                f"{name!r} (their symbolic dims: {known})"
            )
        if value < 1:  # empty runs, or feeds numpy refuses
            raise InputError(f"--dim {name}={value}: a dim must be a positive integer")
    return names


def refuse_pinned_sequence(
    index: GraphIndex,
    hints: ShardHints,
    seq_len: int,
    user_dims: Mapping[str, int],
    shapes: ShapeInference | None = None,
) -> None:
    """Refuse (InputError) a ``--dim`` that sets the one sequence dim of the hints to another
    value than ``seq_len`` (``--seq-len``): it would win, and the length asked for not run."""
    sequence = sequence_dims(index, hints, user_dims, shapes)
    if len(sequence) == 1 and user_dims.get(sequence[0], seq_len) != seq_len:
        name = sequence[0]
        raise InputError(
            f"{index.source}: --dim {name}={user_dims[name]}: {name!r} is the sequence dim (the "
            f"hinted axes carry it), which --seq-len sets ({seq_len}); leave it out of --dim"
        )


def graph_input_dims(index: GraphIndex) -> list[str]:
    """The symbolic dim names of the graph inputs, in order of first appearance."""
    names: dict[str, None] = {}
    for name in index.graph_inputs:
        for dim in index.declared_shape(name) or ():
            if isinstance(dim, str):
                names.setdefault(dim)
    return list(names)


def sequence_dims(
    index: GraphIndex,
    hints: ShardHints,
    user_dims: Mapping[str, int] | None = None,
    shapes: ShapeInference | None = None,
) -> list[str]:
    """The dim names that the hints scatter (see the module docstring for the rule)."""
    names = graph_input_dims(index)
    found: dict[str, None] = {}
    inner: list[tuple[str, int]] = []
    for tensor in hints.inputs:
        if tensor.name in index.graph_inputs:
            dim = _dim_at(index.declared_shape(tensor.name), tensor.seq_len_idx)
            if isinstance(dim, str):
                found.setdefault(dim)
        else:
            inner.append((tensor.name, tensor.seq_len_idx))
    if inner:
        shapes = shapes if shapes is not None else ShapeInference(index)
        for name, axis in inner:
            dim = _dim_at(shapes.shape(name), axis)
            if isinstance(dim, str) and dim in names:
                found.setdefault(dim)
    if found:
        return list(found)
    candidates = [
        name
        for name in _dims_of_inputs(index, _ancestor_inputs(index, [t.name for t in hints.inputs]))
        if not BATCH_LIKE.search(name)
    ]
    if len(candidates) <= 1 or all(name in (user_dims or {}) for name in candidates):
        return candidates
    raise InputError(
        f"{index.source}: cannot tell which dim is the sequence: the hinted sequence axes carry "
        f"no dim name and the inputs have several ({', '.join(candidates)}); pass "
        f"--dim {candidates[0]}=LENGTH for each"
    )


def _dim_at(shape: Sequence[Any] | None, axis: int) -> Any:
    return shape[axis] if shape is not None and axis < len(shape) else None


def _ancestor_inputs(index: GraphIndex, tensors: Sequence[str]) -> list[str]:
    """The graph inputs that ``tensors`` depend on (all graph inputs when none is given)."""
    if not tensors:
        return list(index.graph_inputs)
    seen: set[str] = set()
    stack = list(tensors)
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        producer = index.producer_of(tensor)
        if producer is not None:
            stack.extend(name for name in producer.inputs if name)
    return [name for name in index.graph_inputs if name in seen]


def _dims_of_inputs(index: GraphIndex, inputs: Sequence[str]) -> list[str]:
    names: dict[str, None] = {}
    for name in inputs:
        for dim in index.declared_shape(name) or ():
            if isinstance(dim, str):
                names.setdefault(dim)
    return list(names)


# --------------------------------------------------------------------------- feeds


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


# --------------------------------------------------------------------------- running


def make_session(
    model: onnx.ModelProto | bytes, weights_dir: str | os.PathLike[str] | None = None
) -> onnxruntime.InferenceSession:
    """An onnxruntime CPU session, sequential, one intra-op thread (repeatable and light);
    ``model`` is a proto or its serialized bytes.

    The graph runs as written: no graph optimizations. The runs are few and short (small
    sequence lengths), while optimizing a large graph is most of what making its session
    costs (an 8k-node encoder: 0.93 s with them, 0.36 s without). Nor is memory kept in
    an arena for reuse: with few runs it would only hold on to each run's largest
    allocations (verify of a model with 1.1 GiB of weights peaked at 3.0 GiB with it, at
    2.1 GiB without).

    ``weights_dir``: the directory of the model file, where its external weight files are.
    onnxruntime reads them from there (mapping them into memory) instead of from a copy of
    every weight inside ``model``: a model over 2 GB could not be serialized with its weights
    in it, and the copy would double the memory the weights take.
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4
    options.enable_cpu_mem_arena = False
    if weights_dir is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path",
            str(Path(weights_dir).resolve()),
        )
    serialized = model if isinstance(model, bytes) else model.SerializeToString()
    return onnxruntime.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])


def run_model(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    weights_dir: str | os.PathLike[str] | None = None,
) -> dict[str, np.ndarray]:
    """Run ``model`` once on the CPU; ``outputs`` are graph output names (default: all);
    ``weights_dir`` as for ``make_session``."""
    session = make_session(model, weights_dir)
    names = list(outputs) if outputs is not None else [o.name for o in session.get_outputs()]
    values = session.run(names, dict(feeds))
    return dict(zip(names, values, strict=True))
