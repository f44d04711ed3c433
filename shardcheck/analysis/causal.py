"""Whether an attention layer's mask is causal, and how it is built: a Trilu, a comparison of
Ranges, or a constant triangular matrix (read from its first matrix alone, so that the data of
the weights met on the way is never read).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shardcheck.graph.index import GraphIndex, Node
from shardcheck.graph.ops import SHAPE_OPS

if TYPE_CHECKING:
    import numpy as np

# The nodes looked at behind one mask: a bounded look, linear in the graph.
MAX_MASK_NODES = 80


def causal_mask(index: GraphIndex, masks: tuple[str, ...]) -> str | None:
    """How a causal mask among ``masks`` is built, if there is one."""
    for mask in masks:
        queue = deque([mask])
        seen: set[str] = set()
        while queue and len(seen) < MAX_MASK_NODES:
            tensor = queue.popleft()
            if tensor in seen:
                continue
            seen.add(tensor)
            producer = index.producer_of(tensor)
            # Only a constant (an initializer or a Constant's output) may be a triangular mask.
            if (
                producer is None or producer.op_type == "Constant" or tensor in index.initializers
            ) and _may_be_triangular_constant(index, tensor):
                if _is_triangular_constant(index, tensor):
                    return f"constant triangular mask {tensor}"
            if producer is None:
                continue
            if producer.op_type == "Trilu":
                return f"Trilu node {producer.label}"
            if producer.op_type in ("Less", "LessOrEqual", "Greater", "GreaterOrEqual") and all(
                reaches_range(index, name) for name in producer.inputs[:2]
            ):
                return f"Range comparison node {producer.label}"
            if producer.op_type in SHAPE_OPS:
                # Only its input's shape reaches the mask: how that input was computed (the
                # layers before, for a mask expanded to the hidden states' shape) does not.
                continue
            queue.extend(name for name in producer.inputs if name)
    return None


def reaches_range(
    index: GraphIndex, tensor: str, *, depth: int = 8, excluding: Node | None = None
) -> bool:
    """Whether ``tensor`` is computed from a Range (other than ``excluding``) within ``depth``
    producers (a bounded look: the number of tensors per level is capped)."""
    current = [tensor]
    for _ in range(depth):
        previous: list[str] = []
        for name in current:
            producer = index.producer_of(name)
            if producer is None or (excluding is not None and producer.index == excluding.index):
                continue
            if producer.op_type == "Range":
                return True
            previous.extend(i for i in producer.inputs if i)
        current = previous[:32]
    return False


def _could_be_triangular(dims: tuple[int, ...]) -> bool:
    return len(dims) >= 2 and dims[-1] == dims[-2] and dims[-1] >= 2


def _may_be_triangular_constant(index: GraphIndex, tensor: str) -> bool:
    """Whether ``tensor`` is a constant that ``_is_triangular`` could accept, told from its
    dims and first row alone (that row is zero after its first value), so that the data of
    the other constants met on the way (weights) is never read."""
    proto = index.constant_tensor(tensor)
    if proto is None:
        return False
    dims = tuple(proto.dims)
    if not _could_be_triangular(dims):
        return False
    head = index.raw_values(proto, dims[-1])
    return head is None or all(v == 0 for v in head[1:])


def _is_triangular_constant(index: GraphIndex, tensor: str) -> bool:
    """``_is_triangular`` of a constant, told from its first matrix read with struct where it
    is stored raw (gen leaves numpy unimported: tests/graph/test_lean_reading.py)."""
    proto = index.constant_tensor(tensor)
    if proto is not None:
        rows, columns = int(proto.dims[-2]), int(proto.dims[-1])
        values = index.raw_values(proto, rows * columns)
        if values is not None:
            return _is_triangular_matrix(values, columns)
    value = index.constant_value(tensor)
    return value is not None and _is_triangular(value)


def _is_triangular_matrix(values: Sequence[Any], columns: int) -> bool:
    """``_is_triangular`` of one matrix given row by row: what np.triu(m, 1) keeps (the rest
    zero) is one value, the entry right of the first, and np.tril(m) is not all of it."""
    zero = type(values[0])(0)
    upper = [v if i % columns > i // columns else zero for i, v in enumerate(values)]
    lower = [v if i % columns <= i // columns else zero for i, v in enumerate(values)]
    first = upper[1]
    return all(v == first for v in upper) and not all(v == first for v in lower)


def _is_triangular(value: np.ndarray) -> bool:
    if not _could_be_triangular(value.shape):
        return False
    import numpy as np

    square = value.reshape(-1, value.shape[-2], value.shape[-1])[0]
    upper = np.triu(square, 1)
    lower = np.tril(square)
    return bool(np.all(upper == upper.flat[1]) and not np.all(lower == upper.flat[1]))
