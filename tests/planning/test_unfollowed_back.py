"""A cut that stops at an op the axis rules do not follow back says so (planning/blockers.py's
``unfollowed_back``).

Before GatherND had its rule past its indices (analysis/axes.py), the dynamo exporter's Falcon
with GQA, which picks its K and V heads out of the fused QKV by GatherND, was cut after each
layer's QKV projection: 9.1% of the projection and MLP FLOPs on slices, and no blocker named.
Taking that rule away again on the bundled export shows the blocker the user now gets.
"""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.loader import load_index
from shardcheck.planning.plan import make_plan

MODEL = FIXTURES / "real" / "dynamo_falcon_gqa_tiny.onnx"


def test_the_default_plan_names_no_blocker() -> None:
    result = generate(load_index(MODEL), GenOptions())
    assert result.extension is not None
    plan = make_plan(load_index(MODEL), result.extension.hints)
    assert plan.classes["projections"].share_on_slices == 1.0
    assert plan.blockers == ()


def test_a_gather_nd_without_its_rule_is_named_as_where_the_cut_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = AxisMapper._gather_nd

    def indices_only(self, node, out_axis):  # type: ignore[no-untyped-def]
        indices = self.shapes.rank(node.inputs[1])
        if indices is not None and out_axis >= indices - 1:
            return None  # the rule as it was: the data's axes followed nowhere
        return original(self, node, out_axis)

    monkeypatch.setattr(AxisMapper, "_gather_nd", indices_only)
    result = generate(load_index(MODEL), GenOptions())
    hints = result.extension.hints if result.extension is not None else result.hints
    plan = make_plan(load_index(MODEL), hints)
    assert plan.classes["projections"].share_on_slices < 0.2
    # The first layer's K head pick: the first GatherND of the QKV's 5-D [groups, batch,
    # sequence, heads, head dim] by a [1, 1] index (the mask's GatherND comes before it).
    index = load_index(MODEL)
    shapes = ShapeInference(index)
    first_pick = next(
        node
        for node in index.nodes
        if node.op_type == "GatherND" and shapes.shape(node.inputs[1]) == (1, 1)
    )
    assert shapes.shape(first_pick.inputs[0])[2] == "sequence"  # type: ignore[index]
    assert [blocker.what for blocker in plan.blockers] == [
        f"the sequence is not followed back through GatherND {first_pick.label}"
    ]
    assert "shardcheck has no rule for it there" in plan.blockers[0].fix
