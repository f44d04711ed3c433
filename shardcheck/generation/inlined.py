"""gen's plan for models that call model-local functions: the extension that inlines them.

No hint can name a tensor of a function's body (analysis/hidden.py), so the Polygraphy-format
hints of an export whose blocks are function calls shard none of their attention, and a call
of a function that holds an MLP is an op the sequence is not followed through. gen then finds
the plan of the model with its local functions inlined, as on any export, and offers it as the
extension (``inlined_functions``, sharding/inlined.py): every command that reads it inlines
them the same way first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from shardcheck.analysis.detect import AttentionLayer, detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import ShardcheckError
from shardcheck.generation.extension import FALLBACK_POSITIONS, Extended, PlanShares
from shardcheck.generation.messages import code_of
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import LengthReads, ShardHints
from shardcheck.sharding.inlined import local_functions

if TYPE_CHECKING:
    from shardcheck.generation.options import GenOptions


def inlined_plan(
    index: GraphIndex,
    options: GenOptions,
    hints: ShardHints,
    declined: list[str] | None = None,
) -> Extended | None:
    """The extension that inlines the model's local functions, where the graph calls some and
    the inlined model's default plan splits more of the projection and MLP FLOPs than
    ``hints`` (gen's hints of ``index``) do; None otherwise. A call is one node to the axis
    rules, which follow the sequence through none: attention in a function is no layer a
    hint can name, and a function that holds a block's MLP keeps the MLP whole. Its cut must
    be found without a warning that it is not exact (``declined`` then gets why)."""
    functions = local_functions(index.model)
    called = {(node.domain, node.op_type) for node in index.nodes}
    if called.isdisjoint(functions):
        return None
    # Imported only here: the inliner and the counts are onnx's and numpy's work.
    from shardcheck.generation.generate import generate_detected
    from shardcheck.planning.flop_count import DEFAULT_RANKS
    from shardcheck.sharding.inlined import inlined_index

    try:
        inlined = inlined_index(index, functions)
        found = generate_detected(inlined, options)
    except ShardcheckError:
        return None  # the model's own plan stands: its hints are gen's either way
    inexact = [warning for warning in found.warnings if code_of(warning) == "SC308"]
    if inexact:
        if declined is not None:
            declined.append(f"its cut would not be exact: {inexact[0]}")
        return None
    plan = found.extension.hints if found.extension is not None else found.hints
    if not plan.inputs:
        return None
    plan = plan.with_changes(lengths=replace(plan.lengths or LengthReads(), inlined=functions))
    nb_rank = hints.dist_collectives.nb_rank
    ranks = nb_rank if nb_rank > 1 else DEFAULT_RANKS
    assert found.shapes is not None
    inlined_model = (inlined, found.shapes, list(found.layers))
    given = None
    if hints.inputs:
        shapes = ShapeInference(index)
        given = (index, shapes, detect_attention(index, shapes))
    # Both plans at one length: the default, or FALLBACK_POSITIONS per rank where the
    # extension's cannot be counted at the default (past a position table).
    for seq_len in (None, FALLBACK_POSITIONS * ranks):
        extended = _counted(*inlined_model, plan, seq_len, ranks)
        if extended is None:
            continue
        # None where the calls keep the shapes after them unknown: then the hints' plan is
        # not counted, and the extension's, counted, is offered.
        plain = PlanShares(0.0, 0.0) if given is None else _counted(*given, hints, seq_len, ranks)
        if plain is not None and extended.projections <= plain.projections:
            return None
        return Extended(plan, plain, extended)
    return None  # a plan that cannot be counted is no gain


def _counted(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    hints: ShardHints,
    seq_len: int | None,
    ranks: int,
) -> PlanShares | None:
    """The plan's shares at ``seq_len`` (None: the default); None where it cannot be
    counted there."""
    from shardcheck.planning.flop_count import count_flops

    try:
        return PlanShares.of(
            count_flops(index, shapes, layers, hints, seq_len=seq_len, ranks=ranks)
        )
    except ShardcheckError:
        return None
