"""How a simulation's ranks compare with the single-device run, and where they first differ.

The ranks' graph outputs are compared with the single-device outputs (``compare_outputs``). On
a mismatch (or when a rank cannot run), ``diagnose`` runs both models again with every inner
tensor as an output and names the first tensor, in topological order, where a rank's value
differs from its slice of the single-device tensor, and the node that made it. The slice axis
is the one axis where the rank's shape is the single-device shape divided by N; a tensor that
the shard created stands for the tensor it scatters or gathers. Tensors that only hold shapes
(``Shape`` and the integer arithmetic on it) hold the local length on a rank, by design, and
are not compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from shardcheck.graph.ops import SHAPE_OPS
from shardcheck.runtime.sessions import run_model
from shardcheck.runtime.supervised import watched_run
from shardcheck.simulation.plan import untyped_output
from shardcheck.simulation.rank_values import RankFailure, RankValues
from shardcheck.simulation.simulator import RankSimulator

# The integer arithmetic that exporters write on shapes (Shape -> Gather -> Concat -> Reshape).
SHAPE_ARITHMETIC = frozenset(
    "Gather Slice Concat Unsqueeze Squeeze Cast Reshape Identity Add Sub Mul Div Mod Neg Abs "
    "Max Min Floor Ceil Sqrt Equal Less Greater LessOrEqual GreaterOrEqual Not And Or Where "
    "ReduceProd".split()
)


@dataclass(frozen=True)
class Mismatch:
    """Where a rank first differs from the single-device run."""

    tensor: str  # tensor of the sharded model
    original: str  # the single-device tensor it stands for
    node: str  # the node that made it
    op_type: str
    rank: int
    max_abs_error: float | None  # None when no value could be compared
    detail: str
    failed: bool = False  # the rank could not compute it (onnxruntime or a collective refused)


def compare_outputs(
    simulator: RankSimulator,
    values: RankValues,
    reference: Mapping[str, np.ndarray],
    rtol: float,
    atol: float,
) -> tuple[float, Mismatch | None]:
    """The largest difference over the outputs of every rank, and the first one that differs."""
    worst = 0.0
    for original, name in simulator.sharded.outputs.items():
        if name in simulator.weights:
            continue  # a weight given out as a graph output: one constant on every device
        full = reference[original]
        node, op_type = simulator.made_by(name)
        for rank, rank_values in enumerate(values.per_rank):
            local = rank_values[name]
            if local.shape != full.shape:
                detail = (
                    f"the graph output has shape {list(local.shape)} on the rank but "
                    f"{list(full.shape)} on a single device"
                )
                return worst, Mismatch(name, original, node, op_type, rank, None, detail)
            match, error = compare_values(local, full, rtol, atol)
            if not match:
                detail = "the graph output differs from the single-device output"
                return worst, Mismatch(name, original, node, op_type, rank, error, detail)
            worst = max(worst, error)
    return worst, None


def compare_to_slice(
    local: np.ndarray, full: np.ndarray, rank: int, ranks: int, rtol: float, atol: float
) -> tuple[str, float | None] | None:
    """None when ``local`` equals ``full``, or its ``rank``-th slice along the one axis where
    the shapes differ by a factor ``ranks``; else what is wrong and the max abs error."""
    if local.shape == full.shape:
        expected, against = full, "the single-device tensor"
    elif local.ndim != full.ndim:
        return (
            f"its shape {list(local.shape)} has another rank than the single-device shape "
            f"{list(full.shape)}",
            None,
        )
    else:
        differing = [a for a in range(local.ndim) if local.shape[a] != full.shape[a]]
        if len(differing) != 1 or full.shape[differing[0]] != local.shape[differing[0]] * ranks:
            return (
                f"its shape {list(local.shape)} is neither the single-device shape "
                f"{list(full.shape)} nor a 1/{ranks} slice of it along one axis",
                None,
            )
        axis, length = differing[0], local.shape[differing[0]]
        expected = np.take(full, np.arange(rank * length, (rank + 1) * length), axis=axis)
        against = f"its slice of the single-device tensor along axis {axis}"
    match, error = compare_values(local, expected, rtol, atol)
    return None if match else (f"its value differs from {against}", error)


def compare_values(
    actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float
) -> tuple[bool, float]:
    """Whether two arrays of one shape match (floats within tolerance, NaN equal to NaN, other
    types exactly), and their largest absolute difference (NaN against a number: infinite)."""
    actual, expected = np.atleast_1d(actual), np.atleast_1d(expected)
    if actual.size == 0:
        return True, 0.0
    if not (np.issubdtype(expected.dtype, np.number) or expected.dtype == np.bool_):
        match = bool(np.array_equal(actual, expected))  # strings
        return match, 0.0 if match else float("inf")
    if np.issubdtype(expected.dtype, np.floating):
        close = np.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = actual == expected
    with np.errstate(invalid="ignore"):
        difference = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    difference[(actual == expected) | (np.isnan(difference) & close)] = 0.0
    return bool(np.all(close)), float(np.nan_to_num(difference, nan=np.inf).max())


# --------------------------------------------------------------------------- diagnosing


def diagnose(
    simulator: RankSimulator,
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    rtol: float,
    atol: float,
) -> Mismatch | None:
    """The first tensor, in topological order, where a rank differs from its slice of the
    single-device tensor, or the first node a rank cannot compute."""
    sources = {tail.source for tail in simulator.sharded.tails.values()}
    single = _all_single_device_values(model, feeds, sources, simulator.weights_dir)
    ranks = simulator.run(feeds, diagnostic=True)
    ndim = {name: value.ndim for name, value in single.items()}
    shape_only = shape_only_tensors(simulator.nodes, set(simulator.weights), ndim)
    for node in simulator.nodes:
        if ranks.failure is not None and node.name == ranks.failure.node:
            return failure_mismatch(simulator, ranks.failure)
        for name in node.output:
            tail = simulator.sharded.tails.get(name)
            original = tail.source if tail is not None else name
            if name in shape_only or original not in single:
                continue
            for rank, values in enumerate(ranks.per_rank):
                if name not in values:
                    continue
                problem = compare_to_slice(
                    values[name], single[original], rank, len(ranks.per_rank), rtol, atol
                )
                if problem is not None:
                    made_by, op_type = simulator.made_by(name)
                    return Mismatch(name, original, made_by, op_type, rank, problem[1], problem[0])
    return None if ranks.failure is None else failure_mismatch(simulator, ranks.failure)


def failure_mismatch(simulator: RankSimulator, failure: RankFailure) -> Mismatch:
    """The mismatch of a rank that could not compute: at the tensor of the node that failed."""
    node = next((n for n in simulator.nodes if n.name == failure.node), None)
    if node is None:
        return Mismatch(
            "", "", failure.node or "<unknown node>", "", failure.rank, None, failure.message, True
        )
    if node.name in simulator.tail_of_collective:
        tensor = simulator.tail_of_collective[node.name]
        original = simulator.sharded.tails[tensor].source
    else:
        tensor = original = node.output[0] if node.output else ""
    return Mismatch(
        tensor, original, node.name, node.op_type, failure.rank, None, failure.message, True
    )


def _all_single_device_values(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    sources: set[str],
    weights_dir: Path | None,
) -> dict[str, np.ndarray]:
    """Every tensor of the single-device run, with the initializers that the hints name."""
    inner = onnx.ModelProto()
    inner.CopyFrom(model)
    declared = {output.name for output in inner.graph.output}
    names = [name for node in inner.graph.node for name in node.output if name]
    inner.graph.output.extend(untyped_output(name) for name in names if name not in declared)
    with watched_run("the single-device run that finds where the ranks differ"):
        values = run_model(inner, feeds, weights_dir=weights_dir)
    values.update(feeds)
    base_dir = "" if weights_dir is None else str(weights_dir)
    values.update(
        {
            t.name: numpy_helper.to_array(t, base_dir)
            for t in model.graph.initializer
            if t.name in sources
        }
    )
    return values


def shape_only_tensors(
    nodes: Iterable[onnx.NodeProto], constants: set[str], ndim: Mapping[str, int]
) -> set[str]:
    """Tensors that only hold shapes: Shape/Size outputs and the integer arithmetic on them
    and on constants. ``constants`` grows by the tensors computed from constants only;
    ``ndim`` gives each tensor's rank in the single-device run."""
    shape_only: set[str] = set()
    for node in nodes:
        inputs = [name for name in node.input if name]
        from_shapes = any(name in shape_only for name in inputs) and all(
            name in shape_only or name in constants for name in inputs
        )
        if node.op_type == "Constant" or (inputs and all(name in constants for name in inputs)):
            constants.update(node.output)
        elif node.op_type in SHAPE_OPS:
            shape_only.update(node.output)
        elif from_shapes and (
            (
                node.op_type in SHAPE_ARITHMETIC
                and (node.op_type != "Gather" or inputs[0] in shape_only)
            )
            # TorchScript's Expand arguments: ConstantOfShape(Shape(shape)), a vector.
            or (node.op_type == "ConstantOfShape" and ndim.get(node.output[0], 2) <= 1)
        ):
            shape_only.update(node.output)
    return shape_only
