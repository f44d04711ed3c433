"""Check shard hints by running the sharded model on N simulated ranks (``simulate``).

The model is sharded with the hints (``shard.shard_model``), run on N ranks on the CPU
(``ranks.RankSimulator``: one onnxruntime session per stage, collectives in numpy) and every
rank's outputs are compared with the single-device run on the same seeded inputs. On the happy
path that is the single-device inference plus one pass of every stage per rank, and nothing
else.

On a mismatch (or when a rank cannot run), a diagnostic pass runs both models again with every
inner tensor as an output and names the first tensor, in topological order, where a rank's
value differs from its slice of the single-device tensor, and the node that made it. The slice
axis is the one axis where the rank's shape is the single-device shape divided by N; a tensor
that the shard created stands for the tensor it scatters or gathers. Tensors that only hold
shapes (``Shape`` and the integer arithmetic on it) hold the local length on a rank, by design,
and are not compared.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import mentions, size_at
from shardcheck.errors import InputError
from shardcheck.graph.index import SHAPE_OPS, GraphIndex, gc_paused
from shardcheck.graph.loader import check_weight_files, index_parsed, parse_model, weights_dir
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints, ShardTensor, validated
from shardcheck.lifetime import keep_until_exit
from shardcheck.runtime.background import InBackground
from shardcheck.runtime.feeds import (
    make_feeds,
    make_session,
    refuse_pinned_sequence,
    resolve_dims,
    run_model,
    sequence_dims,
)
from shardcheck.runtime.memory import check_memory, check_weights
from shardcheck.sharding.rewrite import gathered_by_q, shard_model
from shardcheck.simulation.simulator import (
    RankFailure,
    RankSimulator,
    RankValues,
    ort_errors,
    untyped_output,
)
from shardcheck.wording import counted

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


@dataclass(frozen=True)
class SimulationResult:
    ok: bool
    ranks: int
    seq_len: int
    dims: dict[str, int]
    outputs: tuple[str, ...]
    rtol: float
    atol: float
    stages: int
    session_runs: int  # onnxruntime runs, the single-device ones included
    max_abs_error: float = 0.0  # over the outputs that were compared
    mismatch: Mismatch | None = field(default=None)
    # No input dim takes the sequence length (the inputs fix it: image patches): seq_len
    # changed nothing.
    length_fixed: bool = False

    def summary(self) -> str:
        dims = ", ".join(f"{name}={value}" for name, value in self.dims.items()) or "none"
        fixed = (
            f"; the inputs fix the sequence length, so seq_len {self.seq_len} had no effect"
            if self.length_fixed
            else ""
        )
        setting = (
            f"{counted(self.ranks, 'simulated rank')}, {counted(self.stages, 'stage')}, "
            f"dims {dims}, "
            f"rtol {self.rtol:g}, atol {self.atol:g}{fixed}"
        )
        if self.mismatch is None:
            return (
                f"match: every rank's outputs ({', '.join(self.outputs)}) equal the "
                f"single-device run (max abs error {self.max_abs_error:.3g}); {setting}."
            )
        m = self.mismatch
        stands_for = "" if m.tensor == m.original else f" (stands for {m.original!r})"
        error = "" if m.max_abs_error is None else f", max abs error {m.max_abs_error:.3g}"
        where = (
            f"rank {m.rank} cannot compute tensor {m.tensor!r}"
            if m.failed
            else f"first difference on rank {m.rank} at tensor {m.tensor!r}"
        )
        return (
            f"mismatch: {where}{stands_for}, made by node {m.node!r} ({m.op_type}): "
            f"{m.detail}{error}; {setting}."
        )


@dataclass(frozen=True)
class ReferenceRun:
    """Graph outputs of a single-device run already made on ``make_feeds(index, dims, seed)``
    (verify's own runs): the simulation compares with them instead of running again."""

    dims: Mapping[str, int]
    seed: int
    outputs: Mapping[str, np.ndarray]


@gc_paused()  # as verify: many small objects, no cycles
def simulate(
    model_path: str | os.PathLike[str],
    hints: ShardHints | str | os.PathLike[str],
    *,
    ranks: int,
    seq_len: int,
    dims: Mapping[str, int] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
) -> SimulationResult:
    """Shard ``model_path`` with ``hints``, run it on ``ranks`` simulated ranks and compare
    every rank's outputs with the single-device run on the same seeded inputs."""
    _check_ranks(ranks)
    _check_run_settings(ranks, seq_len, rtol, atol)
    simulation = Simulation(model_path, hints, ranks=ranks)
    try:
        # The user's --dim only: verify hands its runs' dims, the sequence's too, to run().
        refuse_pinned_sequence(
            simulation.index, simulation.hints, seq_len, dims or {}, simulation.shapes
        )
    except InputError:
        simulation.settle()
        raise
    result = simulation.run(seq_len, dims=dims, rtol=rtol, atol=atol, seed=seed)
    keep_until_exit(simulation)  # its sessions: freed by the console command's exit
    return result


def _refuse_sub_groups(hints: ShardHints, ranks: int, hints_source: str) -> None:
    """InputError for collectives over part of the ranks: the simulator runs them over all."""
    dist = hints.dist_collectives
    if (dist.groups and list(dist.groups) != list(range(ranks))) or dist.group_size not in (
        0,
        ranks,
    ):
        raise InputError(
            f"{hints_source}: dist_collectives: groups {list(dist.groups)}, group_size "
            f"{dist.group_size}: the simulator runs collectives over all {ranks} ranks only; "
            "simulate hints made without --groups and --gpus, or with --ranks matching them"
        )


def _check_ranks(ranks: int) -> None:
    if ranks < 1:
        raise InputError(f"--ranks {ranks}: expected at least 1 rank")


def _check_run_settings(ranks: int, seq_len: int, rtol: float, atol: float) -> None:
    for option, value in (("--rtol", rtol), ("--atol", atol)):
        if not 0 <= value < math.inf:  # NaN too: every comparison with it is false
            raise InputError(f"{option} {value}: expected a finite number >= 0")
    if seq_len < 1:
        raise InputError(f"--seq-len {seq_len}: the sequence length must be positive")


def first_unsplittable(
    shapes: ShapeInference,
    hints: ShardHints,
    ranks: int,
    dims: Mapping[str, int],
    lengths: Collection[str],
) -> tuple[ShardTensor, int] | None:
    """The first hinted input whose scattered axis, at ``dims``, has a length that is not a
    multiple of ``ranks`` (every rank holds as many positions), with that length. Only an
    axis that follows the ``lengths`` dims counts: one of them, or computed from one (a speech
    model's frames, from its samples); a length fixed by the model, or a batch, is left to
    the simulation, which names it."""
    for tensor in hints.inputs:
        shape = shapes.shape(tensor.name)
        if shape is None or tensor.seq_len_idx >= len(shape):
            continue
        dim = shape[tensor.seq_len_idx]
        if not any(mentions(dim, name) for name in lengths):
            continue
        size = size_at(dim, dims)
        # None or below 1: the model does not run at this length, which its run reports.
        if size is not None and size > 0 and size % ranks:
            return tensor, size
    return None


def unsplittable_message(tensor: ShardTensor, size: int, ranks: int) -> str:
    return (
        f"{tensor.name!r} is scattered along its axis {tensor.seq_len_idx}, which then has "
        f"{size} positions, not a multiple of the {ranks} ranks"
    )


class Simulation:
    """A model sharded with its hints, ready to run on ``ranks`` simulated ranks at any
    sequence length. The sharded model, the stage sessions and the single-device session are
    made once and serve every length (verify runs two).

    ``index``, ``layers`` (Q -> gathered K and V of each layer) and ``shapes``: what the
    caller has already found of the model, so that it is not found again.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        hints: ShardHints | str | os.PathLike[str],
        *,
        ranks: int,
        index: GraphIndex | None = None,
        layers: dict[str, list[tuple[str, str]]] | None = None,
        shapes: ShapeInference | None = None,
        hints_source: str = "<hints>",
    ) -> None:
        """``hints_source``: the file ``hints`` was read from, when given as ShardHints."""
        _check_ranks(ranks)
        self.ranks = ranks
        self._single_device: Any = None
        self._single_device_making: InBackground[Any] | None = None
        try:
            self._prepare(model_path, hints, ranks, index, layers, shapes, hints_source)
        except Exception:
            # No onnxruntime work is left running behind an error: a process that ends while
            # a session is being made crashes.
            if self._single_device_making is not None:
                self._single_device_making.wait()
            raise

    def _prepare(
        self,
        model_path: str | os.PathLike[str],
        hints: ShardHints | str | os.PathLike[str],
        ranks: int,
        index: GraphIndex | None,
        layers: dict[str, list[tuple[str, str]]] | None,
        shapes: ShapeInference | None,
        hints_source: str,
    ) -> None:
        if index is None:
            index = self._load(model_path)  # the parse refuses a bad path first
        else:
            check_weights(index)
            check_weight_files(index, model_path)
        self.index = index
        self.weights_dir = weights_dir(model_path)
        if isinstance(hints, ShardHints):
            hints = validated(hints, hints_source)
        else:
            hints_source, hints = str(hints), read_hints(hints)
        self.hints = hints
        _refuse_sub_groups(hints, ranks, hints_source)
        self.shapes = shapes = shapes if shapes is not None else ShapeInference(index)
        if layers is None:
            layers = gathered_by_q(detect_attention(index, shapes))
        sharded = shard_model(index, hints, layers, hints_source=hints_source, shapes=shapes)
        # The model as the file has it: external weights are read by onnxruntime, from their
        # files, in each session that needs them.
        self.model = index.model
        self.simulator = RankSimulator(sharded, self.model, ranks, self.weights_dir)

    def _load(self, model_path: str | os.PathLike[str]) -> GraphIndex:
        """The model's index. The session of the single-device run (the reference, unless
        the caller has one) is made in the background from here on, while the model is
        checked, analysed and sharded: making it is most of that run's cost."""
        parsed = parse_model(model_path, keep_bytes=True)
        index = index_parsed(parsed)
        check_weights(index)
        check_weight_files(index, model_path)
        self._single_device_making = InBackground(
            "shardcheck-single-device",
            make_session,
            parsed.serialized or index.model.SerializeToString(),
            weights_dir(model_path),
        )
        parsed.check()
        return index

    def settle(self) -> None:
        """Wait for the onnxruntime work started in the background (none is left behind)."""
        self.simulator.stop_making_ahead()
        if self._single_device_making is not None:
            self._single_device_making.wait()

    def run(
        self,
        seq_len: int,
        *,
        dims: Mapping[str, int] | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-5,
        seed: int = 0,
        reference: ReferenceRun | None = None,
    ) -> SimulationResult:
        """Run the ranks at ``seq_len`` and compare their outputs with the single-device run
        (``reference`` when it was made with the same dims and seed). Afterwards no stage
        session is left being made ahead: a run that stopped early (a mismatch, an error)
        does not leave onnxruntime working behind it."""
        try:
            return self._run(seq_len, dims, rtol, atol, seed, reference)
        finally:
            self.simulator.stop_making_ahead()

    def _run(
        self,
        seq_len: int,
        dims: Mapping[str, int] | None,
        rtol: float,
        atol: float,
        seed: int,
        reference: ReferenceRun | None,
    ) -> SimulationResult:
        _check_run_settings(self.ranks, seq_len, rtol, atol)
        index, simulator = self.index, self.simulator
        resolved = resolve_dims(index, self.hints, seq_len, dims or {}, self.shapes)
        lengths = sequence_dims(index, self.hints, dims or {}, self.shapes)
        # The dims set to the length (verify hands its own dims, its batch among them).
        at_length = [name for name in lengths if resolved.get(name) == seq_len]
        unsplit = first_unsplittable(self.shapes, self.hints, self.ranks, resolved, at_length)
        if unsplit is not None:
            tensor, size = unsplit
            raise InputError(
                f"--seq-len {seq_len}: the sequence length must be a positive multiple of the "
                f"{self.ranks} ranks, so that every rank holds as many positions"
                if size == seq_len
                else f"--seq-len {seq_len}: {unsplittable_message(tensor, size, self.ranks)}; "
                "choose a length at which it is, so that every rank holds as many positions"
            )
        check_memory(index, resolved, seq_len=seq_len, option="--seq-len", shapes=self.shapes)
        feeds = make_feeds(index, resolved, seed)
        single_device_runs = 0
        if reference is not None and dict(reference.dims) == resolved and reference.seed == seed:
            expected: Mapping[str, np.ndarray] = reference.outputs
        else:
            expected = self._run_single_device(feeds, resolved)
            single_device_runs = 1

        worst = 0.0
        runs_before = simulator.session_runs
        try:
            values = simulator.run(feeds)
        except RankFailure as failure:
            first: Mismatch | None = _failure_mismatch(simulator, failure)
        else:
            worst, first = _compare_outputs(simulator, values, expected, rtol, atol)
        if first is not None:
            first = _diagnose(simulator, self.model, feeds, rtol, atol) or first
            single_device_runs += 1
        return SimulationResult(
            ok=first is None,
            ranks=self.ranks,
            seq_len=seq_len,
            dims=resolved,
            outputs=tuple(index.graph_outputs),
            rtol=rtol,
            atol=atol,
            stages=simulator.stage_count,
            session_runs=simulator.session_runs - runs_before + single_device_runs,
            max_abs_error=worst,
            mismatch=first,
            length_fixed=not lengths,
        )

    def _run_single_device(
        self, feeds: Mapping[str, np.ndarray], dims: Mapping[str, int]
    ) -> dict[str, np.ndarray]:
        names = list(self.index.graph_outputs)
        try:
            if self._single_device is None:
                making = self._single_device_making
                self._single_device = (
                    making.result()
                    if making is not None
                    else make_session(self.model, self.weights_dir)
                )
            values = self._single_device.run(names, dict(feeds))
        except ort_errors() as error:
            chosen = ", ".join(f"{name}={value}" for name, value in dims.items()) or "none"
            raise InputError(
                f"{self.index.source}: the single-device model does not run with dims "
                f"{chosen}: {' '.join(str(error).split())}"
            ) from None
        return dict(zip(names, values, strict=True))


# --------------------------------------------------------------------------- comparing


def _compare_outputs(
    simulator: RankSimulator,
    values: RankValues,
    reference: Mapping[str, np.ndarray],
    rtol: float,
    atol: float,
) -> tuple[float, Mismatch | None]:
    """The largest difference over the outputs of every rank, and the first one that differs."""
    worst = 0.0
    for original, name in simulator.sharded.outputs.items():
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


def _diagnose(
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
            return _failure_mismatch(simulator, ranks.failure)
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
    return None if ranks.failure is None else _failure_mismatch(simulator, ranks.failure)


def _failure_mismatch(simulator: RankSimulator, failure: RankFailure) -> Mismatch:
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
