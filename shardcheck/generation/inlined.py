"""gen's plan for attention inside model-local functions: the extension that inlines them.

No hint can name a tensor of a function's body (analysis/hidden.py), so the Polygraphy-format
hints of an export whose blocks are function calls shard none of their attention. gen then
finds the plan of the model with its local functions inlined, as on any export, and offers it
as the extension (``inlined_functions``, sharding/inlined.py): every command that reads it
inlines them the same way first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from shardcheck.analysis.hidden import hidden_attention
from shardcheck.errors import ShardcheckError
from shardcheck.generation.extension import Extended, PlanShares
from shardcheck.generation.messages import code_of
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import LengthReads, ShardHints

if TYPE_CHECKING:
    from shardcheck.generation.options import GenOptions


def inlined_plan(
    index: GraphIndex,
    options: GenOptions,
    hints: ShardHints,
    declined: list[str] | None = None,
) -> Extended | None:
    """The extension that inlines the model's local functions, where some hold attention and
    the inlined model's default plan splits more of the projection and MLP FLOPs than
    ``hints`` (gen's hints of ``index``) do; None otherwise. Its cut must be found without a
    warning that it is not exact (``declined`` then gets why)."""
    if not any(place.in_function for place in hidden_attention(index.model)):
        return None
    # Imported only here: the inliner and the counts are onnx's and numpy's work.
    from shardcheck.generation.generate import generate_detected
    from shardcheck.planning.plan import DEFAULT_RANKS, count_flops
    from shardcheck.sharding.inlined import inlined_index, local_functions

    functions = local_functions(index.model)
    inlined = inlined_index(index, functions)
    found = generate_detected(inlined, options)
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
    try:
        if found.extension is not None:
            extended = found.extension.extended
        else:
            assert found.shapes is not None
            extended = PlanShares.of(
                count_flops(inlined, found.shapes, list(found.layers), plan, ranks=ranks)
            )
        plain = PlanShares(0.0, 0.0)
        if hints.inputs:
            from shardcheck.analysis.detect import detect_attention
            from shardcheck.analysis.shapes import ShapeInference

            shapes = ShapeInference(index)
            layers = detect_attention(index, shapes)
            plain = PlanShares.of(count_flops(index, shapes, layers, hints, ranks=ranks))
    except ShardcheckError:
        return None  # a plan that cannot be counted is no gain
    if extended.projections <= plain.projections:
        return None
    return Extended(plan, plain, extended)
