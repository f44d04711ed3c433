"""ONNX RotaryEmbedding (opset 23) on a rank's slice (analysis/axes.py, issue 27).

At opset 23 the dynamo exporter writes Llama's rotary positions as one RotaryEmbedding per Q and
K (fixtures/real/dynamo_llama_tiny_gqa_opset23.onnx): X [batch, heads, S, head], cos and sin
[1, S, 4]. Each position is rotated by its own row of the tables, so the sequence is followed
through it and the projections run on slices, as at opset 18. onnxruntime runs that export at
batch 1 only: its RotaryEmbedding does not broadcast tables of one batch row over a batch of 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import FIXTURES, gen_plan, run_cli
from projection_count import projection_share_on_slices

from shardcheck import load_index
from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

MODEL = FIXTURES / "real" / "dynamo_llama_tiny_gqa_opset23.onnx"


def test_the_sequence_axis_goes_through_each_rotary_node() -> None:
    index = load_index(MODEL)
    shapes = ShapeInference(index)
    mapper = AxisMapper(index, shapes, "sequence")
    rotaries = [node for node in index.nodes if node.op_type == "RotaryEmbedding"]
    assert len(rotaries) == 4  # Q and K of 2 layers
    for node in rotaries:
        x, cos, sin = node.inputs[:3]
        assert shapes.shape(node.outputs[0]) == shapes.shape(x)
        assert shapes.shape(x)[2] == "sequence"
        # Along S: X's positions and the tables' rows, each at its own position.
        assert sorted(mapper.input_axes(node, 2)) == sorted([(x, 2), (cos, 1), (sin, 1)])
        # Along heads and features: X alone; along the batch, not the one-row tables.
        assert mapper.input_axes(node, 1) == [(x, 1)]
        assert mapper.input_axes(node, 3) == [(x, 3)]
        assert mapper.input_axes(node, 0) == [(x, 0)]


def test_the_default_plan_splits_the_projections_and_is_exact(tmp_path: Path) -> None:
    hints, extension = gen_plan(MODEL, tmp_path)
    plan_file = extension or hints
    plan = make_plan(load_index(MODEL), read_hints(plan_file))
    assert plan.classes["projections"].share_on_slices >= 0.95
    multi_device = tmp_path / "md.onnx"
    assert run_cli("shard", MODEL, plan_file, "-o", multi_device).exit_code == 0
    assert projection_share_on_slices(multi_device) >= 0.95
    for ranks in (2, 4):
        result = run_cli("verify", MODEL, plan_file, "--ranks", ranks, "-q")
        assert result.exit_code == 0, (ranks, result.stdout)


@pytest.mark.parametrize(("batch", "runs"), [(1, True), (2, False)])
def test_onnxruntime_runs_the_export_at_batch_1_only(batch: int, runs: bool) -> None:
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(3, 64, size=(batch, 8), dtype=np.int64),
        "attention_mask": np.ones((batch, 8), dtype=np.int64),
    }
    if runs:
        assert session.run(None, feeds)[0].shape == (batch, 8, 32)
    else:
        with pytest.raises(Exception, match="RotaryEmbedding"):
            session.run(None, feeds)
