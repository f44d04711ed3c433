"""The plan in words: the terminal's text, the JSON object, gen's one-line summary."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardcheck.analysis.detect import AttentionLayer, detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import ShardcheckError
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints
from shardcheck.planning.flop_count import (
    CLASS_TITLES,
    CLASSES,
    DEFAULT_RANKS,
    FlopCount,
    count_flops,
)
from shardcheck.wording import counted, human, one_line

if TYPE_CHECKING:
    # Only the type: gen's line of the plan counts FLOPs alone, and the plan's memory
    # count imports onnx and numpy (runtime/memory.py), which gen does not need.
    from shardcheck.planning.plan import Plan


def percent(share: float) -> str:
    """``share`` (0 to 1) as a percentage with one decimal: ``95.6%``."""
    return f"{100 * share:.1f}%"


def summary_line(plan: FlopCount) -> str:
    """One line: the share on slices, by the two classes that matter, and the bound."""
    attention, projections = plan.classes["attention"], plan.classes["projections"]
    left_out = (
        f", {counted(plan.uncounted_projections, 'node')} of unknown shapes not counted"
        if plan.uncounted_projections
        else ""
    )
    return (
        f"{plan.model}: plan at length {plan.seq_len} on {counted(plan.ranks, 'rank')}: "
        f"{percent(plan.flops_on_slices)} of FLOPs on slices (attention core "
        f"{percent(attention.share_on_slices)}, projections and MLP "
        f"{percent(projections.share_on_slices)}{left_out}), speed-up at most "
        f"{plan.speedup_bound:.2f}x"
    )


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON values (the ``plan`` object of explain's and verify's JSON)."""
    return {
        "model": plan.model,
        "hints": plan.hints,
        "seq_len": plan.seq_len,
        "ranks": plan.ranks,
        "dims": dict(sorted(plan.dims.items())),
        "flops_on_slices": round(plan.flops_on_slices, 6),
        "speedup_bound": round(plan.speedup_bound, 4),
        "flops": {
            "single_device": plan.flops_total,
            "per_rank": plan.flops_per_rank,
            "by_class": {
                name: {
                    "on_slices": plan.classes[name].on_slices,
                    "whole": plan.classes[name].whole,
                    "share_on_slices": round(plan.classes[name].share_on_slices, 6),
                }
                for name in CLASSES
            },
            "uncounted_nodes": plan.uncounted_nodes,
            "uncounted_projections": plan.uncounted_projections,
            "uncounted_selected": plan.uncounted_selected,
        },
        "activation_memory": {
            "peak_bytes_one_device": plan.peak_bytes_one_device,
            "peak_bytes_per_rank": plan.peak_bytes_per_rank,
        },
        "collectives": [
            {
                "operation": c.operation,
                "role": c.role,
                "tensor": c.tensor,
                "axis": c.axis,
                "layer": c.layer,
                "bytes_received_per_rank": c.bytes_received,
            }
            for c in plan.collectives
        ],
        "layers": [
            {
                "name": layer.name,
                "op_type": layer.op_type,
                "q_local": layer.q_local,
                "collectives": list(layer.gathers),
                "bytes_received_per_rank": layer.bytes_received,
                "projections_on_slices": round(layer.projections_on_slices, 6),
            }
            for layer in plan.layers
        ],
        "blockers": [
            {"what": b.what, "tensor": b.tensor, "node": b.node, "fix": b.fix}
            for b in plan.blockers
        ],
    }


def render_json(
    plan: Plan,
    plans: Mapping[str, Any] | None = None,
    not_exact: Sequence[str] | None = None,
) -> str:
    """explain's JSON: the ``plan``; ``plans``, how much each of gen's plans splits
    (generation/extension.py; null for hints given); ``not_exact``, where gen's plan has no
    exact cut, as gen warns (SC308; null for hints given, which nothing checked)."""
    document = {
        "plan": plan_dict(plan),
        "plans": plans,
        "not_exact": None if not_exact is None else list(not_exact),
    }
    return json.dumps(document, indent=2) + "\n"


def render_text(plan: Plan, plans_line: str | None = None, not_exact: Sequence[str] = ()) -> str:
    """explain's text; ``plans_line``: how much each of gen's plans splits, after the
    hints' line; ``not_exact``: where gen's plan has no exact cut (its SC308 warnings)."""
    exactness = (
        [
            f"not exact: {counted(len(not_exact), 'place')} without an exact cut, first: "
            f"{not_exact[0]}; verify's simulation shows whether the split run differs"
        ]
        if not_exact
        else []
    )
    lines = [
        summary_line(plan),
        f"hints: {plan.hints}",
        *([f"plans: {plans_line}"] if plans_line else []),
        *exactness,
        "",
        "FLOPs (single device)      on slices        whole  share",
    ]
    for name in CLASSES:
        flops = plan.classes[name]
        lines.append(
            f"  {CLASS_TITLES[name]:<24} {flops.on_slices:>10} {flops.whole:>12}  "
            f"{percent(flops.share_on_slices):>6}"
        )
    lines.append(
        f"  {'all':<24} {sum(c.on_slices for c in plan.classes.values()):>10} "
        f"{sum(c.whole for c in plan.classes.values()):>12}  {percent(plan.flops_on_slices):>6}"
    )
    lines.append(
        f"per rank: {plan.flops_per_rank} FLOPs of {plan.flops_total}; speed-up bound "
        f"{plan.speedup_bound:.2f}x (communication not counted)"
    )
    if plan.uncounted_nodes:
        among = (
            f", {plan.uncounted_projections} of them projections or MLP, which the share of "
            "that class leaves out"
            if plan.uncounted_projections
            else ""
        )
        how_many = (
            "all"
            if plan.uncounted_selected == plan.uncounted_nodes
            else f"{plan.uncounted_selected} of them"
        )
        selected = (
            f"; {how_many} sized by the rows a selection picks (each expert's tokens), which "
            "only a run tells"
            if plan.uncounted_selected
            else ""
        )
        lines.append(
            f"not counted: {counted(plan.uncounted_nodes, 'node')} of unknown shapes{among}"
            f"{selected}"
        )
    lines.append(
        f"peak activation memory: {human(plan.peak_bytes_per_rank)} per rank, "
        f"{human(plan.peak_bytes_one_device)} on one device"
    )
    lines.append("")
    lines.extend(_layer_lines(plan))
    if plan.blockers:
        lines.append("")
        lines.append("what keeps work whole:")
        for blocker in plan.blockers:
            lines.append(f"  {blocker.what}; {blocker.fix}")
    # Names come from the file: escaped, one cannot forge a line or send the terminal a code.
    return "\n".join(one_line(line) for line in lines) + "\n"


def _layer_lines(plan: Plan) -> list[str]:
    """The layers folded: consecutive layers of one form are one line with a count."""
    lines = ["layers (each rank)"]
    for group in fold_layers(plan):
        first = group[0]
        span = first.name if len(group) == 1 else f"{len(group)} layers from {first.name}"
        received = "?" if first.bytes_received is None else human(first.bytes_received)
        collectives = ", ".join(_counted_roles(first.gathers)) or "no collectives"
        q = "Q local" if first.q_local else "Q whole"
        lines.append(
            f"  {span}: {q}; {collectives}; receives {received} per layer; projections "
            f"{percent(first.projections_on_slices)} on slices"
        )
    outputs = [c for c in plan.collectives if c.role == "gather output" and c.layer is None]
    if outputs:
        lines.append(f"  then: {counted(len(outputs), 'output')} gathered")
    return lines


def _counted_roles(roles: tuple[str, ...]) -> list[str]:
    found: dict[str, int] = {}
    for role in roles:
        found[role] = found.get(role, 0) + 1
    return [role if n == 1 else f"{n}x {role}" for role, n in found.items()]


def layer_form(layer: Any) -> tuple[object, ...]:
    return (
        layer.op_type,
        layer.q_local,
        tuple(sorted(layer.gathers)),
        layer.bytes_received,
        round(layer.projections_on_slices, 4),
    )


def fold_layers(plan: Plan) -> list[list[Any]]:
    groups: list[list[Any]] = []
    for layer in plan.layers:
        if groups and layer_form(groups[-1][0]) == layer_form(layer):
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


def gen_summary(
    index: GraphIndex,
    hints: ShardHints,
    nb_rank: int,
    analysed: tuple[ShapeInference, list[AttentionLayer]] | None = None,
) -> str | None:
    """gen's line of the plan it wrote: at the default length, on ``nb_rank`` ranks (2 when
    the hints say 1); the reason when the plan cannot be counted; None without a cut.
    ``analysed``: the model's shapes and attention layers, when already found."""
    if not hints.inputs:
        return None
    ranks = nb_rank if nb_rank > 1 else DEFAULT_RANKS
    try:
        if analysed is None:
            shapes = ShapeInference(index)
            analysed = shapes, detect_attention(index, shapes)
        plan = count_flops(index, *analysed, hints, ranks=ranks)
    except ShardcheckError as exc:
        return f"plan not counted: {exc.message}"
    return summary_line(plan) + " ('shardcheck explain' says more)"
