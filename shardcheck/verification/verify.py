"""``verify``: do the hints fit the model? Static checks (static_checks.py), then onnxruntime
runs at several lengths (run_checks.py), then the CP simulation (unless ``simulate`` is off).

The static part reads only the graph index. The runtime part runs the model once per sequence
length with every hinted tensor, and each layer's Q and gathered K and V, exposed as outputs,
and compares shapes across the runs: the axis that changes with the length is the sequence axis,
whatever the dims are called. Axes that agree are necessary, not sufficient (a bias built from
each rank's local length passes them), so the CP simulation runs too: on ``ranks`` ranks, by
default on the hints' own nb_rank or else 2 (``default_ranks``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardcheck.analysis.detect import (
    AttentionLayer,
    detect_attention,
    gathered_by_q,
    layer_tensors,
)
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import BATCH_LIKE, size_at
from shardcheck.errors import HintsMismatchError, InputError, ShardcheckError
from shardcheck.generation.options import DEFAULT_SEQ_LENS
from shardcheck.graph.index import GraphIndex, gc_paused
from shardcheck.graph.loader import index_parsed, parse_model
from shardcheck.hints.codec import validated
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints
from shardcheck.runtime.memory import refuse_oversized_weights
from shardcheck.runtime.settings import (
    refuse_bad_own_lengths,
    refuse_bad_ranks,
    refuse_bad_seq_lens,
    refuse_bad_timeout,
    refuse_bad_tolerances,
    tolerances_or_defaults,
)
from shardcheck.runtime.sizes import default_dim, refuse_bad_user_dims, resolve_dims
from shardcheck.runtime.supervised import run_supervised, send_progress
from shardcheck.sharding.inlined import planned_index
from shardcheck.simulation.simulate import (
    ReferenceRun,
    Simulation,
    first_unsplittable,
    unsplittable_message,
)
from shardcheck.verification.findings import ERROR, INFO, WARNING, Report
from shardcheck.verification.run_checks import DimChooser, RuntimeCheck
from shardcheck.verification.session import PendingSession, Progress
from shardcheck.verification.static_checks import check_static
from shardcheck.verification.walks import watched_tensors
from shardcheck.wording import counted, listed

# The ranks verify simulates when neither --ranks nor the hints' nb_rank says.
DEFAULT_SIMULATED_RANKS = 2


# Its analysis makes many small objects and no cycles; the collector only walked them again
# and again.
def verify_in_child(
    model_path: str | os.PathLike[str],
    hints: ShardHints | str | os.PathLike[str],
    *,
    timeout: float,
    progress: Progress | None = None,
    **options: Any,
) -> Report:
    """``verify`` with its ``timeout`` enforced even on one long kernel, which onnxruntime's
    own stop (between nodes) lets run to its end: made in a child process that is killed
    past it (runtime/supervised.py), the memory of its runs freed. For callers whose process
    must go on (the gate, the pytest plugin); it costs the start of that process."""
    refuse_bad_timeout(timeout)
    arguments = {
        "model_path": model_path,
        "hints": hints,
        "timeout": timeout,
        "progress": send_progress if progress is not None else None,
        **options,
    }
    return run_supervised(
        verify, arguments, timeout=timeout, source=str(model_path), progress=progress
    )


@gc_paused()
def verify(
    model_path: str | os.PathLike[str],
    hints: ShardHints | str | os.PathLike[str],
    *,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    dims: Mapping[str, int] | None = None,
    seq_len_of: Mapping[str, Sequence[int]] | None = None,
    ranks: int | None = None,
    simulate: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    hints_source: str = "<hints>",
) -> Report:
    """Check ``hints`` against ``model_path``; every finding is collected, not only the first.

    ``ranks``: the ranks the CP simulation runs on; by default ``default_ranks(hints)``, and
    then a simulation that cannot run is a warning (SC204), not an input error. ``simulate``
    off: no simulation (``ranks`` must then be None). ``rtol``, ``atol``: the simulation's
    tolerances, by default those of the outputs' element type (``default_tolerances``).
    ``hints_source``: what messages call ``hints`` when it is a ShardHints, not a file."""
    refuse_bad_seq_lens(seq_lens)
    own_lengths = dict(seq_len_of or {})
    refuse_bad_own_lengths(own_lengths, seq_lens)
    refuse_bad_timeout(timeout)
    refuse_bad_tolerances(rtol, atol)
    if ranks is not None:
        refuse_bad_ranks(ranks)
        if not simulate:
            raise InputError(
                f"--ranks {ranks} and --no-simulate: --ranks is the number of ranks the "
                "simulation runs on; give one of the two"
            )
    parsed = parse_model(model_path)
    if isinstance(hints, ShardHints):
        hints = validated(hints, hints_source)
    else:
        hints_source, hints = str(hints), read_hints(hints)
    report = Report(model=str(model_path), hints=hints_source)
    asked = ranks is not None
    if simulate and ranks is None:
        ranks = default_ranks(hints)
    # The graph the hints name tensors of: with an extension's functions inlined, a model of
    # its own, which the runs serialize anew.
    index = planned_index(index_parsed(parsed), hints, hints_source)
    serialized = parsed.serialized if not index.inlined_functions else None
    output_types = (index.elem_type(output) for output in index.graph_outputs)
    rtol, atol = tolerances_or_defaults(rtol, atol, output_types)
    # onnxruntime loads the model while the analysis and the checker run (the session is only
    # used once both have passed); the weights must fit first.
    refuse_oversized_weights(index)
    early = {layer.q: layer for layer in layer_tensors(index)}
    watched = watched_tensors(index, hints, early)
    pending = PendingSession(index, Path(model_path), watched, serialized)
    simulation: Simulation | ShardcheckError | None = None
    try:
        try:
            shapes = ShapeInference(index)
            layers = detect_attention(index, shapes)
            by_q = {layer.q: layer for layer in layers}
            check_static(index, shapes, hints, layers, report, ranks)
            choose = _dim_chooser(
                index, shapes, layers, hints, dict(dims or {}), (own_lengths, seq_lens)
            )
            if ranks is not None:
                unsplittable = _unsplittable_lengths(shapes, hints, ranks, seq_lens, choose)
                fixed = None if asked else _unsplittable_fixed(shapes, hints, ranks, choose)
                if unsplittable is not None and asked:
                    raise InputError(
                        f"--ranks {ranks}: {unsplittable}; choose --seq-lens accordingly"
                    )
                if unsplittable is not None:
                    _not_simulated(
                        report,
                        ranks,
                        unsplittable,
                        f"give --seq-lens whose scattered axes divide by {ranks}, or --ranks",
                    )
                    ranks = None
                elif fixed is not None:
                    _not_simulated(report, ranks, fixed, "give --ranks a divisor of that size")
                    ranks = None
            runtime = RuntimeCheck(
                index, hints, by_q, report, seed, timeout, progress, shapes=shapes
            )
            if ranks is not None:
                simulation = _prepared_simulation(
                    model_path, hints, hints_source, ranks, index, layers, shapes
                )
            runtime.prepare(pending, list(seq_lens), choose)
        except Exception:
            parsed.check()  # the checker's verdict on an invalid model comes first
            raise
        # The checker holds the GIL for its whole run, and onnxruntime takes the GIL back
        # most often early in the making of the session: checked last, the session waits less.
        parsed.check()
        runtime.run(pending, list(seq_lens), choose)
        # A model that runs only at its traced length is simulated there.
        baked = runtime.baked.ran_at if runtime.baked is not None else ()
        lengths = list(seq_lens if runtime.ran else baked)
        if isinstance(simulation, Simulation) and not lengths:
            simulation.simulator.stop_making_ahead()
        matched = None
        if ranks is not None and lengths:
            matched = False
            if isinstance(simulation, HintsMismatchError):
                # The hints were read and the model runs: what keeps them from sharding it
                # is a finding about the hints, beside those above.
                report.add(
                    "SC203",
                    ERROR,
                    "simulation",
                    f"the CP simulation on {ranks} ranks cannot shard the model with these "
                    f"hints: {simulation.message}",
                    expected="shardable",
                    observed="refused",
                )
            elif isinstance(simulation, ShardcheckError):
                if asked:
                    raise simulation  # what the simulator cannot do, not a fault of the hints
                matched = None
                _not_simulated(
                    report, ranks, simulation.message, "simulate the hints on other --ranks"
                )
            else:
                assert simulation is not None
                settings = _SimulationSettings(ranks, rtol, atol, seed)
                matched = _simulate(
                    simulation, settings, lengths, choose, runtime, report, progress
                )
        runtime.check_baked(matched, ranks)
    except Exception:
        # No onnxruntime work is left running behind an error: a process that ends while a
        # session is being made crashes.
        pending.settle()
        if isinstance(simulation, Simulation):
            simulation.simulator.stop_making_ahead()
        raise
    _add_plan(report, index, hints, ranks, (shapes, layers))
    return report


def _add_plan(
    report: Report,
    index: GraphIndex,
    hints: ShardHints,
    ranks: int | None,
    found: tuple[ShapeInference, list[AttentionLayer]],
) -> None:
    """The plan of the hints, counted at the default length (planning/), from the shapes and
    layers verify ``found``."""
    from shardcheck.planning.flop_count import DEFAULT_RANKS
    from shardcheck.planning.plan import make_plan
    from shardcheck.planning.report import plan_dict, summary_line

    if not hints.inputs:
        return
    try:
        shapes, layers = found
        plan = make_plan(
            index,
            hints,
            ranks=ranks or DEFAULT_RANKS,
            hints_source=report.hints,
            shapes=shapes,
            layers=layers,
        )
    except ShardcheckError as exc:
        report.plan_line = f"plan: not counted: {exc.message}"
        return
    report.plan_line = f"plan: {summary_line(plan)}"
    report.plan = plan_dict(plan)


def _prepared_simulation(
    model_path: str | os.PathLike[str],
    hints: ShardHints,
    hints_source: str,
    ranks: int,
    index: GraphIndex,
    layers: list[AttentionLayer],
    shapes: ShapeInference,
) -> Simulation | ShardcheckError:
    """The simulation, prepared while onnxruntime is still making the session of verify's own
    runs (its stage sessions are made in the background beside it). It is used, and an error in
    preparing it reported (hints that do not fit the model as SC203, else raised), only if the
    model runs."""
    try:
        return Simulation(
            model_path,
            hints,
            ranks=ranks,
            index=index,
            layers=gathered_by_q(layers),
            shapes=shapes,
            hints_source=hints_source,
        )
    except ShardcheckError as error:
        return error


def _dim_chooser(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    hints: ShardHints,
    user_dims: dict[str, int],
    own: tuple[dict[str, Sequence[int]], Sequence[int]] = ({}, ()),
) -> DimChooser:
    """The dims of each run. The sequence dims are those the attention's query axes carry,
    found from the model, not from the hints under test (wrong hints would otherwise pick the
    dim that is varied, and a wrong axis could pass); an encoder-decoder's encoder and decoder
    lengths are two, both set to the run's length. (A length only keys have, a memory's, is
    not varied: it may be held whole.) Where the attention's length is fixed (ViT's patches),
    nothing is varied; only without attention do the hints decide. ``own``: the lengths some
    sequence dims take instead, one per run of the lengths given beside (an encoder-decoder
    traced with a source and a target length of its own: ``--seq-len target=6,12``)."""
    names = refuse_bad_user_dims(index, user_dims)
    sequences: list[str] = []
    for layer in layers:
        q_shape = shapes.shape(layer.q)
        if q_shape is not None and layer.q_axis is not None:
            dim = q_shape[layer.q_axis]
            if isinstance(dim, str) and dim in names and dim not in sequences:
                sequences.append(dim)
    if not sequences:
        # The attention axes did not resolve to a dim name: one non-batch dim among the inputs
        # is still the model's own answer; only with several do the hints decide.
        candidates = [name for name in names if not BATCH_LIKE.search(name)]
        sequences = candidates if len(candidates) == 1 else []
    for sequence in sequences:
        if sequence in user_dims:
            # Pinned, it would be the same in every run: nothing would show the sequence axes.
            raise InputError(
                f"{index.source}: --dim {sequence}={user_dims[sequence]}: {sequence!r} is a "
                "sequence dim, which verify sets to each of --seq-lens; leave it out of --dim"
            )
    own_lengths, seq_lens = own
    for name in own_lengths:
        if name not in sequences:
            raise InputError(
                f"{index.source}: --seq-len {name}=...: {name!r} is not a sequence dim of the "
                f"model (those its attention's query axes carry: {', '.join(sequences) or 'none'})"
                f"; set another dim with --dim {name}=VALUE"
            )
    if not sequences and not layers:
        return lambda length: resolve_dims(index, hints, length, user_dims)

    def choose(length: int) -> dict[str, int]:
        run = list(seq_lens).index(length) if length in seq_lens else None
        return {
            name: user_dims.get(
                name,
                (own_lengths[name][run] if name in own_lengths and run is not None else length)
                if name in sequences
                else default_dim(name),
            )
            for name in names
        }

    return choose


def default_ranks(hints: ShardHints) -> int:
    """The ranks verify simulates unless told: the hints' own number when they give one above
    1 (the largest nb_rank of their collectives and fused attentions, their group's size, the
    ranks their groups list), else 2, the fewest at which a cut shows."""
    collectives = hints.dist_collectives
    given = [collectives.nb_rank, collectives.group_size, len(collectives.groups)]
    given += [layer.replace.nb_rank for layer in hints.attention_layers if layer.replace]
    return max(given) if max(given) > 1 else DEFAULT_SIMULATED_RANKS


def _not_simulated(report: Report, ranks: int, why: str, what_to_do: str) -> None:
    """SC204: the default simulation could not run, and so proved nothing."""
    report.add(
        "SC204",
        WARNING,
        "simulation",
        f"the CP simulation on {ranks} ranks did not run ({why}), so nothing shows that "
        f"these hints give the single-device result when the model runs split: {what_to_do}",
        expected="simulated",
        observed="not run",
    )


def _unsplittable_lengths(
    shapes: ShapeInference,
    hints: ShardHints,
    ranks: int,
    seq_lens: Sequence[int],
    choose: DimChooser,
) -> str | None:
    """Why the simulation cannot run at ``seq_lens``: a length at which a scattered axis is
    not a multiple of the ranks; None if it can."""
    # The dims a run's length sets: those that differ between two lengths.
    first, second = choose(seq_lens[0]), choose(seq_lens[1])
    lengths = [name for name, value in first.items() if second.get(name) != value]
    found = {n: first_unsplittable(shapes, hints, ranks, choose(n), lengths) for n in seq_lens}
    bad = {n: unsplit for n, unsplit in found.items() if unsplit is not None}
    if not bad:
        return None
    if all(size == n for n, (_, size) in bad.items()):
        which = f"{listed([str(n) for n in bad])} {'is' if len(bad) == 1 else 'are'} not"
        return f"every sequence length must be a multiple of the number of ranks ({which})"
    length, (tensor, size) = next(iter(bad.items()))
    return f"at sequence length {length}, {unsplittable_message(tensor, size, ranks)}"


def _unsplittable_fixed(
    shapes: ShapeInference, hints: ShardHints, ranks: int, choose: DimChooser
) -> str | None:
    """Why the simulation cannot run on ``ranks`` at any length: a scattered axis whose size
    the model fixes (ViT's patches) is not a multiple of them; None if none is. (With
    ``--ranks`` given, the simulation itself names it, as SC201.)"""
    for tensor in hints.inputs:
        shape = shapes.shape(tensor.name)
        if shape is None or tensor.seq_len_idx >= len(shape):
            continue
        dim = shape[tensor.seq_len_idx]
        size = size_at(dim, choose(DEFAULT_SEQ_LENS[0]))
        fixed = size == size_at(dim, choose(DEFAULT_SEQ_LENS[1]))
        if size is not None and size > 0 and size % ranks and fixed:
            return (
                f"{tensor.name!r} is scattered along its axis {tensor.seq_len_idx}, which the "
                f"model fixes at {counted(size, 'position')}, not a multiple of the {ranks} ranks"
            )
    return None


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class _SimulationSettings:
    ranks: int
    rtol: float
    atol: float
    seed: int


def _simulate(
    simulation: Simulation,
    settings: _SimulationSettings,
    seq_lens: Sequence[int],
    choose: DimChooser,
    runtime: RuntimeCheck,
    report: Report,
    progress: Progress | None,
) -> bool:
    """Simulate CP at each length until one does not match; whether every one did."""
    ranks = settings.ranks
    for length in seq_lens:
        if progress is not None:
            progress(f"simulating CP on {ranks} ranks at sequence length {length}...")
        ran = runtime.graph_outputs.get(length)
        result = simulation.run(
            length,
            dims=choose(length),
            rtol=settings.rtol,
            atol=settings.atol,
            seed=settings.seed,
            reference=None if ran is None else ReferenceRun(ran[0], settings.seed, ran[1]),
        )
        run = {
            "simulation": True,
            "ranks": ranks,
            "seq_len": length,
            "dims": dict(result.dims),
            "ok": result.ok,
        }
        if result.length_fixed:
            run["length_fixed"] = True
        report.runs.append(run)
        if result.ok:
            # The inputs fix the length (image patches): every other length runs the same.
            at = "at the length its inputs fix" if result.length_fixed else f"at length {length}"
            report.add(
                "SC202",
                INFO,
                "simulation",
                f"{counted(ranks, 'simulated rank')} {at} "
                f"{'matches' if ranks == 1 else 'match'} the single-device run "
                f"(largest difference {result.max_abs_error:.3g})",
                expected="match",
                observed="match",
            )
            if result.length_fixed:
                return True
        else:
            report.add(
                "SC201",
                ERROR,
                "simulation",
                result.summary(),
                tensor=result.mismatch.tensor if result.mismatch else "",
                expected="match",
                observed="differs",
            )
            return False
    return True
