"""Check shard hints by running the sharded model on N simulated ranks (``simulate``).

The model is sharded with the hints (``shard.shard_model``), run on N ranks on the CPU
(``simulator.RankSimulator``: one onnxruntime session per stage, collectives in numpy) and every
rank's outputs are compared with the single-device run on the same seeded inputs. On the happy
path that is the single-device inference plus one pass of every stage per rank, and nothing
else; on a mismatch (or when a rank cannot run), a diagnostic pass names the first tensor where
a rank differs (compare.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcheck.analysis.detect import detect_attention, gathered_by_q
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import mentions, size_at
from shardcheck.errors import InputError
from shardcheck.graph.index import GraphIndex, gc_paused
from shardcheck.graph.loader import check_weight_files, index_parsed, parse_model, weights_dir
from shardcheck.hints.codec import validated
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints, ShardTensor
from shardcheck.runtime.background import InBackground
from shardcheck.runtime.feeds import make_feeds
from shardcheck.runtime.memory import refuse_oversized_run, refuse_oversized_weights
from shardcheck.runtime.sessions import error_text, make_session, onnxruntime_errors
from shardcheck.runtime.settings import (
    refuse_bad_ranks,
    refuse_bad_run_settings,
    tolerances_or_defaults,
)
from shardcheck.runtime.sizes import refuse_pinned_sequence, resolve_dims, sequence_dims
from shardcheck.runtime.supervised import watched_run
from shardcheck.sharding.inlined import planned_index
from shardcheck.sharding.rewrite import shard_model
from shardcheck.simulation.collectives import refuse_bad_group
from shardcheck.simulation.compare import Mismatch, compare_outputs, diagnose, failure_mismatch
from shardcheck.simulation.rank_values import RankFailure
from shardcheck.simulation.simulator import RankSimulator
from shardcheck.wording import counted, shown


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
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> SimulationResult:
    """Shard ``model_path`` with ``hints``, run it on ``ranks`` simulated ranks and compare
    every rank's outputs with the single-device run on the same seeded inputs (within
    ``rtol`` and ``atol``; by default those of the outputs' element type)."""
    refuse_bad_ranks(ranks)
    refuse_bad_run_settings(seq_len, rtol, atol)
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
    return result


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
        refuse_bad_ranks(ranks)
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
            refuse_oversized_weights(index)
            check_weight_files(index, model_path)
        self.weights_dir = weights_dir(model_path)
        if isinstance(hints, ShardHints):
            hints = validated(hints, hints_source)
        else:
            hints_source, hints = str(hints), read_hints(hints)
        self.hints = hints
        # The single-device run stays the file's model: what the inlined graph must match.
        planned = planned_index(index, hints, hints_source)
        if planned is not index:
            index, layers, shapes = planned, None, None
        self.index = index
        refuse_bad_group(
            f"{hints_source}: dist_collectives",
            hints.dist_collectives.groups,
            hints.dist_collectives.group_size,
            ranks,
        )
        self.shapes = shapes = shapes if shapes is not None else ShapeInference(index)
        if layers is None:
            layers = gathered_by_q(detect_attention(index, shapes))
        sharded = shard_model(index, hints, layers, hints_source=hints_source, shapes=shapes)
        # The model as the file has it: the sessions share its weights (runtime/weights.py).
        self.model = index.model
        self.simulator = RankSimulator(sharded, self.model, ranks, self.weights_dir)

    def _load(self, model_path: str | os.PathLike[str]) -> GraphIndex:
        """The model's index. The session of the single-device run (the reference, unless
        the caller has one) is made in the background from here on, while the model is
        checked, analysed and sharded: making it is most of that run's cost."""
        parsed = parse_model(model_path)
        index = index_parsed(parsed)
        refuse_oversized_weights(index)
        check_weight_files(index, model_path)
        self._single_device_making = InBackground(
            "shardcheck-single-device",
            functools.partial(
                make_session,
                initializers=list(index.initializers.values()),
                source=index.source,
            ),
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
        rtol: float | None = None,
        atol: float | None = None,
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
        rtol: float | None,
        atol: float | None,
        seed: int,
        reference: ReferenceRun | None,
    ) -> SimulationResult:
        refuse_bad_run_settings(seq_len, rtol, atol)
        index, simulator = self.index, self.simulator
        output_types = (index.elem_type(output) for output in index.graph_outputs)
        rtol, atol = tolerances_or_defaults(rtol, atol, output_types)
        resolved = resolve_dims(index, self.hints, seq_len, dims or {}, self.shapes)
        lengths = sequence_dims(index, self.hints, dims or {}, self.shapes)
        # The dims set to the length (verify hands its own dims, its batch among them).
        at_length = [name for name in lengths if resolved.get(name) == seq_len]
        unsplit = first_unsplittable(self.shapes, self.hints, self.ranks, resolved, at_length)
        if unsplit is not None:
            tensor, size = unsplit
            raise InputError(
                f"--seq-len {shown(seq_len)}: the sequence length must be a positive multiple of "
                f"the {shown(self.ranks)} ranks, so that every rank holds as many positions"
                if size == seq_len
                else f"--seq-len {shown(seq_len)}: "
                f"{unsplittable_message(tensor, size, self.ranks)}; "
                "choose a length at which it is, so that every rank holds as many positions"
            )
        refuse_oversized_run(
            index, resolved, seq_len=seq_len, option="--seq-len", shapes=self.shapes
        )
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
            first: Mismatch | None = failure_mismatch(simulator, failure)
        else:
            worst, first = compare_outputs(simulator, values, expected, rtol, atol)
        if first is not None:
            first = diagnose(simulator, self.model, feeds, rtol, atol) or first
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
                    else make_session(self.model, self.weights_dir, source=self.index.source)
                )
            with watched_run("the simulation's single-device run"):
                values = self._single_device.run(names, dict(feeds))
        except onnxruntime_errors() as error:
            chosen = ", ".join(f"{name}={value}" for name, value in dims.items()) or "none"
            raise InputError(
                f"{self.index.source}: the single-device model does not run with dims "
                f"{chosen}: {error_text(str(error))}"
            ) from None
        return dict(zip(names, values, strict=True))
