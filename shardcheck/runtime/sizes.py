"""The size each symbolic dim of the graph inputs takes in a run.

Which value each symbolic dim gets (``resolve_dims``):

1. ``--dim NAME=VALUE`` (``user_dims``) wins;
2. the sequence dims get ``seq_len``. They are the dim names on the hinted sequence axes: the
   declared dim at ``seq_len_idx`` of each hinted graph input, and the symbolic dim that shape
   propagation finds at ``seq_len_idx`` of each hinted inner tensor. When no hinted axis carries
   a name, the sequence dim is the one dim name of the graph inputs the hinted tensors depend on
   that is not batch-like; several candidates are an error that asks for ``--dim``;
3. a batch-like name (``batch``, ``batch_size``, ``bs``, ``N``) gets 1, any other name 2
   (``default_dim``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.errors import InputError
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints

BATCH_DIM_DEFAULT = 1
OTHER_DIM_DEFAULT = 2


def default_dim(name: str) -> int:
    """The size of a dim that neither ``--dim`` nor the sequence length sets."""
    return BATCH_DIM_DEFAULT if BATCH_LIKE.search(name) else OTHER_DIM_DEFAULT


def resolve_dims(
    index: GraphIndex,
    hints: ShardHints,
    seq_len: int,
    user_dims: Mapping[str, int],
    shapes: ShapeInference | None = None,
) -> dict[str, int]:
    """A value for every symbolic dim of the graph inputs (rules in the module docstring);
    ``shapes``: the model's, when already inferred."""
    names = refuse_bad_user_dims(index, user_dims)
    sequence = set(sequence_dims(index, hints, user_dims, shapes))
    dims: dict[str, int] = {}
    for name in names:
        if name in user_dims:
            dims[name] = user_dims[name]
        elif name in sequence:
            dims[name] = seq_len
        else:
            dims[name] = default_dim(name)
    return dims


def refuse_bad_user_dims(index: GraphIndex, user_dims: Mapping[str, int]) -> list[str]:
    """Refuse (InputError) a ``--dim`` the graph inputs do not have, or below 1; else the
    names of the inputs' symbolic dims."""
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


def graph_input_dims(index: GraphIndex, inputs: Sequence[str] | None = None) -> list[str]:
    """The symbolic dim names of ``inputs`` (default: every graph input), in order of first
    appearance."""
    names: dict[str, None] = {}
    for name in index.graph_inputs if inputs is None else inputs:
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
    ancestors = _ancestor_inputs(index, [t.name for t in hints.inputs])
    candidates = [
        name for name in graph_input_dims(index, ancestors) if not BATCH_LIKE.search(name)
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
