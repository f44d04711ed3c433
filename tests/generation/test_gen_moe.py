"""gen's plan of a dynamo mixture-of-experts decoder (issue 27's QA, finding 1).

HF Mixtral's batched experts, as the dynamo exporter writes them, route over the flattened
tokens [batch*sequence, hidden]: a TopK over each token's expert scores and a GatherND of each
token's experts' weights. Both are position-wise along the tokens, so the only ops mixing
positions are attention: the extension must run the experts on slices and stay exact.
"""

from __future__ import annotations

from pathlib import Path

from conftest import FIXTURES, run_cli

from shardcheck import load_index
from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import detect_attention, sequence_dim
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

MODEL = FIXTURES / "real" / "dynamo_mixtral_moe_tiny.onnx"


def test_the_experts_routing_keeps_the_token_axis() -> None:
    index = load_index(MODEL)
    shapes = ShapeInference(index)
    mapper = AxisMapper(index, shapes, sequence_dim(shapes, detect_attention(index, shapes)))
    topk = next(node for node in index.nodes if node.op_type == "TopK")
    # The experts' weights [4, 128, 32] gathered by each token's expert [tokens, 1].
    gather = next(
        node
        for node in index.nodes
        if node.op_type == "GatherND" and shapes.shape(node.inputs[0]) == (4, 128, 32)
    )
    # TopK selects along the experts (its last axis); each token's row is its own.
    assert mapper.input_axes(topk, 0) == [(topk.inputs[0], 0)]
    assert mapper.input_axes(topk, 1) is None
    # GatherND picks [token, 128, 32] weights by the indices' rows: the token axis is theirs,
    # the weight's own axes are the weight's, past the one indexed, and no token's.
    assert mapper.input_axes(gather, 0) == [(gather.inputs[1], 0)]
    assert mapper.input_axes(gather, 1) == [(gather.inputs[0], 1)]
    assert gather.inputs[0] in index.initializers


def test_gen_writes_the_extension_that_splits_the_experts(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    result = run_cli("gen", MODEL, "-o", hints)
    assert result.exit_code == 0, result.stderr
    extension = tmp_path / "h.shardcheck.json"
    assert extension.exists(), result.stderr
    assert f"'shardcheck shard' with the extension {extension}: 100.0%" in result.stderr
    plan = make_plan(load_index(MODEL), read_hints(extension))
    assert plan.classes["projections"].share_on_slices >= 0.95
    for ranks in (2, 4):
        for batch in (1, 2):
            verified = run_cli(
                "verify", MODEL, extension, "--ranks", ranks, "--dim", f"batch={batch}", "-q"
            )
            assert verified.exit_code == 0, (ranks, batch, verified.stdout, verified.stderr)
