"""gen's second plan: the extension (hints/extension.py), where it splits more or is exact where
the hints are not.

The Polygraphy-format frontier must place every cut where each Shape reads the length its
readers need; where that puts the cut deep inside each layer, the frontier of the extension
(``find_frontier(lengths_by_reader=True)``), carried out by ``shardcheck shard`` with each node
given its length (sharding/lengths.py), may run the projections and the MLP on slices too. gen
offers it when it counts more of their FLOPs on slices (planning/'s figure) than the hints do,
or, at the same cut, when the lengths it gives remove places the hints leave without an exact
cut (a Reshape of the scores sized by the whole length along the queries).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shardcheck.analysis.baked import baked_lengths
from shardcheck.analysis.detect import AttentionLayer, sequence_dims
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import InputError, ShardcheckError
from shardcheck.frontier.search import find_frontier
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints

if TYPE_CHECKING:
    from shardcheck.planning.flop_count import FlopCount
    from shardcheck.sharding.rewrite import ShardedModel

# Positions per rank of the length the plans are counted at when the default one is too long.
FALLBACK_POSITIONS = 8


@dataclass(frozen=True)
class PlanShares:
    """The share of the projection and MLP FLOPs that run on slices, and of all FLOPs."""

    projections: float
    flops: float

    @classmethod
    def of(cls, plan: FlopCount) -> PlanShares:
        return cls(plan.classes["projections"].share_on_slices, plan.flops_on_slices)


@dataclass(frozen=True)
class Extended:
    """The extension's plan (``hints``, with their lengths) and both plans' shares; ``plain``
    None where the hints' plan cannot be counted (shapes past a function call unknown)."""

    hints: ShardHints
    plain: PlanShares | None
    extended: PlanShares


def extended_plan(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    hints: ShardHints,
    plain_warnings: int,
    declined: list[str] | None = None,
) -> Extended | None:
    """The extension of ``hints`` (gen's Polygraphy-format hints, whose frontier warned
    ``plain_warnings`` times), or None where it would neither split more nor be exact where
    the hints are not, or may not be exact: the same cut (unless it leaves no place without
    an exact cut where the hints leave some, and has lengths to give), a length traced into
    the model, more places without an exact cut, a node of its multi-device model that the
    shapes on a rank show broadcasting a whole length against a rank's, or fewer projection
    FLOPs on slices (no more, but where it makes exact what the hints do not). Counted at the
    default length on the hints' ``nb_rank`` ranks (2 when 1), as ``gen --plan`` counts.
    Where it is declined as not exact, ``declined`` gets why, naming the place, for gen to
    say."""
    given = (index, shapes, layers)
    traced: tuple[str, ...] = ()
    if any(baked_lengths(index, shapes, dim) for dim in sequence_dims(shapes, layers)):
        # A length traced into Reshapes (of any sequence dim: an encoder-decoder's decoder's
        # too): the plan is found on the model whose traced Reshapes read their input's
        # length, which the extension names for the shard to make (sharding/traced.py).
        from shardcheck.sharding.traced import untraced

        found_untraced = untraced(index, shapes, layers)
        if found_untraced is None:
            return None  # a traced Reshape that cannot read its length: that length only
        index, shapes, layers = found_untraced.index, found_untraced.shapes, found_untraced.layers
        traced = found_untraced.traced
    frontier = find_frontier(index, shapes, layers, lengths_by_reader=True)
    # No place without an exact cut where the hints have some: the lengths make them exact.
    exacter = plain_warnings > 0 and not frontier.warnings
    if len(frontier.warnings) > plain_warnings:
        if declined is not None:
            declined.append(f"its cut would not be exact: {frontier.warnings[0]}")
        return None
    if not frontier.inputs:
        return None
    cut = hints.with_changes(inputs=tuple(frontier.inputs), outputs=tuple(frontier.outputs))
    for_output = frontier.for_output
    for_readers = frontier.kv_for_readers
    if cut == hints and not traced and not exacter:
        return None
    # Imported only here: where the cut is the same, gen needs none of the sharding or the
    # count. Neither imports onnx nor numpy (tests/graph/test_lean_reading.py).
    from shardcheck.planning.flop_count import DEFAULT_RANKS
    from shardcheck.sharding.lengths import length_readers, mixed_lengths
    from shardcheck.sharding.rewrite import shard_model

    try:
        # Weightless: these models are counted, never run or written.
        sharded = shard_model(
            index,
            cut,
            shapes=shapes,
            detected=layers,
            weights=False,
            for_output=for_output,
            for_readers=for_readers,
        )
        lengths, model = length_readers(index, shapes, layers, cut, sharded, frontier.region_nodes)
        del sharded
        if cut == hints and not traced and not (lengths.whole or lengths.rank):
            return None  # nothing for the lengths to give: the hints as they are
        extended = cut.with_changes(
            lengths=replace(lengths, traced=traced, for_output=for_output, for_readers=for_readers)
        )
        mixed = mixed_lengths(index, shapes, extended, model)
        if mixed is not None:
            if declined is not None:
                declined.append(
                    f"node {mixed} of its multi-device model would mix the whole sequence "
                    "length with a rank's length"
                )
            return None
        nb_rank = hints.dist_collectives.nb_rank
        ranks = nb_rank if nb_rank > 1 else DEFAULT_RANKS
        plain, found = _shares(given, (hints, extended), ranks, model)
    except ShardcheckError:
        return None  # a plan that cannot be counted (a length it cannot split) is no gain
    if found.projections < plain.projections or (
        found.projections == plain.projections and not exacter
    ):
        return None
    return Extended(extended, plain, found)


def _shares(
    given: tuple[GraphIndex, ShapeInference, list[AttentionLayer]],
    plans: tuple[ShardHints, ShardHints],
    ranks: int,
    model: ShardedModel,
) -> tuple[PlanShares, PlanShares]:
    """Both plans' shares at the default length, or at a short one (FALLBACK_POSITIONS per
    rank) where a model cannot be counted at the default (past its position table); the
    extension's counted on its multi-device model ``model`` (made concrete by the count)."""
    from shardcheck.planning.flop_count import count_flops

    def shares(seq_len: int | None, made: ShardedModel | None) -> tuple[PlanShares, PlanShares]:
        plain, extended = (
            PlanShares.of(
                count_flops(
                    *given, hints, seq_len=seq_len, ranks=ranks, sharded=made if at else None
                )
            )
            for at, hints in enumerate(plans)
        )
        return plain, extended

    try:
        return shares(None, model)
    except InputError:
        return shares(FALLBACK_POSITIONS * ranks, None)  # ``model`` may be half made concrete


def shares_line(extended: Extended, extension_file: str | None) -> str:
    """gen's line of the two plans: "Polygraphy-compatible hints: 0.0% of the projection and
    MLP FLOPs on slices; 'shardcheck shard' with the extension FILE: 100.0%"."""
    from shardcheck.planning.report import percent

    where = f" {extension_file}" if extension_file else ""
    plain = (
        "not counted (shapes unknown past a function call)"
        if extended.plain is None
        else f"{percent(extended.plain.projections)} of the projection and MLP FLOPs on slices"
    )
    return (
        f"Polygraphy-compatible hints: {plain}; 'shardcheck shard' with the extension{where}: "
        f"{percent(extended.extended.projections)}"
        + (" of the projection and MLP FLOPs on slices" if extended.plain is None else "")
    )


def extension_report(extended: Extended | None, written: str | None) -> dict[str, object] | None:
    """The extension in gen's JSON report: the file written (null with ``-o -``) and both
    plans' shares of the projection and MLP FLOPs on slices; None where gen offers none."""
    if extended is None:
        return None
    return {
        "file": written,
        "hints": _shares_dict(extended.plain),
        "extension": _shares_dict(extended.extended),
    }


def plans_report(extended: Extended | None) -> dict[str, object] | None:
    """explain's ``plans``: each of gen's plans' shares of the projection and MLP FLOPs and of
    all FLOPs on slices, and which one gen writes as the default plan; None without an
    extension (the hints are the only plan)."""
    if extended is None:
        return None
    return {
        "written": "extension",
        "hints": _shares_dict(extended.plain),
        "extension": _shares_dict(extended.extended),
    }


def _shares_dict(shares: PlanShares | None) -> dict[str, float] | None:
    if shares is None:
        return None
    return {
        "projections_on_slices": round(shares.projections, 6),
        "flops_on_slices": round(shares.flops, 6),
    }
