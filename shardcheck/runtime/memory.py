"""Will an onnxruntime run fit in memory? An estimate from the shapes, made before running.

verify and the CP simulation run the model at lengths a user picks; at a long length the
attention scores alone, ``[batch, heads, S, S]`` per layer, can need terabytes. Rather than let
numpy or onnxruntime fail on the allocation (or the kernel kill the process), the run is
refused when the estimate exceeds the memory available.

The estimate is a lower bound of the peak, so that a refusal is never a false alarm:

- the weights (initializers, external ones included: they are loaded before the run);
- the graph inputs (the feeds) and the tensors kept until the end (graph outputs, and the inner
  tensors that verify exposes as outputs);
- twice the largest intermediate tensor (an op reads one large tensor while it writes another);
- for each fused attention node (``Attention``, ``MultiHeadAttention`` ...), the score matrix
  that it computes inside, ``Q[..., :-1]`` times the key length.

Shapes are the symbolic ones of ``ShapeInference`` with the run's dims substituted; an axis
whose size is unknown counts as 1, an element type that is unknown as 4 bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import factors
from shardcheck.errors import InputError
from shardcheck.graph.index import Dim, GraphIndex, Shape
from shardcheck.wording import human, shown

DEFAULT_ITEMSIZE = 4
_MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1: a container's limit is often far below the machine's MemAvailable.
_CGROUP_LIMITS = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ),
)


@dataclass(frozen=True)
class Estimate:
    """Bytes a run needs at least, and the largest tensor (what to blame in a refusal)."""

    total: int
    largest: str
    largest_shape: tuple[int, ...]
    largest_bytes: int


def resolve(shape: Shape, dims: Mapping[str, int]) -> tuple[int, ...]:
    """A symbolic shape with ``dims`` substituted; unknown or negative sizes count as 1."""
    return tuple(_resolve_dim(dim, dims) for dim in shape)


def _resolve_dim(dim: Dim, dims: Mapping[str, int]) -> int:
    if isinstance(dim, int):
        return dim if dim >= 0 else 1
    if isinstance(dim, str):
        if dim in dims:  # a name, whatever it spells (a dim_param "2*3" is not six)
            return dims[dim]
        # Merged dims are written "a*b" or "2*a" by shape propagation.
        number, symbols = factors(dim)
        return number * math.prod(dims.get(symbol, 1) for symbol in symbols)
    return 1


def _itemsize(index: GraphIndex, tensor: str) -> int:
    elem_type = index.elem_type(tensor)
    return _type_itemsize(elem_type) if elem_type else DEFAULT_ITEMSIZE


@functools.cache
def _type_itemsize(elem_type: int) -> int:
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return DEFAULT_ITEMSIZE
    return dtype.itemsize if dtype.kind in "biufc" else DEFAULT_ITEMSIZE


def estimate(
    index: GraphIndex,
    dims: Mapping[str, int],
    *,
    shapes: ShapeInference | None = None,
    layers: Iterable[AttentionLayer] = (),
    kept: Iterable[str] = (),
) -> Estimate:
    """The memory a run of ``index`` with ``dims`` needs at least (see the module docstring).

    ``kept``: inner tensors that stay alive until the end (exposed as outputs).
    """
    shapes = shapes if shapes is not None else ShapeInference(index)
    # Repeated layers repeat their shapes: each distinct one is resolved once.
    resolved: dict[Shape, tuple[int, tuple[int, ...]]] = {}

    def size(tensor: str) -> tuple[int, tuple[int, ...]]:
        shape = shapes.shape(tensor)
        if shape is None:
            return 0, ()
        known = resolved.get(shape)
        if known is None:
            concrete = resolve(shape, dims)
            known = resolved[shape] = (math.prod(concrete), concrete)
        return known[0] * _itemsize(index, tensor), known[1]

    weights = weights_bytes(index)
    ends = dict.fromkeys([*index.graph_inputs, *index.graph_outputs, *kept])
    sized = {name: size(name) for name in ends}
    whole = sum(nbytes for nbytes, _ in sized.values())
    inner = 0  # the largest intermediate tensor
    for node in index.nodes:
        for output in node.outputs:
            if output and output not in sized:
                sized[output] = found = size(output)
                if found[0] > inner:
                    inner = found[0]
    scores = 0
    for layer in layers:
        if layer.kind == "fused":  # a score MatMul's output is one of the tensors above
            sized[f"scores of {layer.name}"] = _fused_scores(shapes, dims, layer)
            scores += sized[f"scores of {layer.name}"][0]
    largest = max(sized, key=lambda name: sized[name][0], default="")
    largest_bytes, largest_shape = sized.get(largest, (0, ()))
    return Estimate(
        total=weights + whole + 2 * inner + scores,
        largest=largest,
        largest_shape=largest_shape,
        largest_bytes=largest_bytes,
    )


def weights_bytes(index: GraphIndex) -> int:
    """The size of the initializers (external ones included)."""
    return sum(
        math.prod(int(d) for d in tensor.dims) * _itemsize(index, name)
        for name, tensor in index.initializers.items()
    )


def _fused_scores(
    shapes: ShapeInference, dims: Mapping[str, int], layer: AttentionLayer
) -> tuple[int, tuple[int, ...]]:
    q, k = shapes.shape(layer.q), shapes.shape(layer.gathered_k)
    if q is None or k is None or len(q) < 2 or layer.k_axis is None or layer.k_axis >= len(k):
        return 0, ()
    shape = resolve(q[:-1], dims) + (_resolve_dim(k[layer.k_axis], dims),)
    return math.prod(shape) * 4, shape  # scores are float32 at least


def available_bytes() -> int | None:
    """Memory this process can still use: MemAvailable, capped by a cgroup limit; None when
    the system does not say (not Linux)."""
    found: list[int] = []
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in _CGROUP_LIMITS:
        try:
            limit = limit_file.read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                found.append(max(0, int(limit) - int(usage_file.read_text().strip())))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def refuse_oversized_run(
    index: GraphIndex,
    dims: Mapping[str, int],
    *,
    seq_len: int,
    option: str = "--seq-lens",
    shapes: ShapeInference | None = None,
    layers: Iterable[AttentionLayer] = (),
    kept: Iterable[str] = (),
    available: int | None = None,
) -> Estimate:
    """Refuse (InputError) a run that needs more memory than is available; else the estimate.

    ``available`` defaults to ``available_bytes()``; when that is unknown nothing is refused.
    """
    needed = estimate(index, dims, shapes=shapes, layers=layers, kept=kept)
    if available is None:
        available = available_bytes()
    if available is not None and needed.total > available:
        chosen = ", ".join(f"{name}={shown(value)}" for name, value in dims.items()) or "none"
        raise InputError(
            f"{index.source}: sequence length {shown(seq_len)} (dims {chosen}) needs about "
            f"{human(needed.total)} of memory, more than the {human(available)} available "
            f"(largest tensor {needed.largest!r} {shown(list(needed.largest_shape))}: "
            f"{human(needed.largest_bytes)}); refused before running: choose a shorter "
            f"{option} or smaller --dim values"
        )
    return needed


def refuse_oversized_weights(index: GraphIndex, *, available: int | None = None) -> int:
    """Refuse (InputError) a model whose weights alone need more memory than is available,
    before onnxruntime loads them; else their size. ``refuse_oversized_run`` refuses the runs."""
    weights = weights_bytes(index)
    if available is None:
        available = available_bytes()
    if available is not None and weights > available:
        raise InputError(
            f"{index.source}: its weights need {human(weights)} of memory, more than the "
            f"{human(available)} available; refused before loading them into onnxruntime"
        )
    return weights
