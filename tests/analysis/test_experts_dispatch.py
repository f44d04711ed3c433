"""The TorchScript exporter's mixture of experts (HF batched_mm, fixtures/real/
ts_qwen3_moe_tiny.onnx): each token's hidden state [batch*sequence, 32] is repeated for its
top 2 experts by a Tile whose repeats [1, 2, 1] a OneHot computes from the Shape of TopK's
indices, then Flatten-ed to [2*batch*sequence, 32]; shape inference knows those shapes and the
axis rules follow the tokens through them (issue 27).
"""

from __future__ import annotations

from conftest import FIXTURES
from onnx import TensorProto, helper

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.loader import load_index

MODEL = FIXTURES / "real" / "ts_qwen3_moe_tiny.onnx"
EXPERTS = "/model/layers.0/mlp/experts"


def _node(index: GraphIndex, name: str):  # type: ignore[no-untyped-def]
    return next(node for node in index.nodes if node.name == name)


def test_the_tile_repeats_and_the_repeated_tokens_have_shapes() -> None:
    index = load_index(MODEL)
    shapes = ShapeInference(index)
    # OneHot(indices [1], depth 3, values [off 1, on k=2]): [[1, 2, 1]], reshaped to [3].
    assert shapes.value(f"{EXPERTS}/OneHot_output_0") == (1, 2, 1)
    assert shapes.value(f"{EXPERTS}/Reshape_1_output_0") == (1, 2, 1)
    assert shapes.shape(f"{EXPERTS}/Tile_output_0") == ("batch*sequence", 2, 32)
    assert shapes.shape(f"{EXPERTS}/Flatten_output_0") == ("2*batch*sequence", 32)
    # Each routed token by its expert's [64, 32]: a column of 64 per (token, expert) pair.
    assert shapes.shape(f"{EXPERTS}/MatMul_output_0") == ("2*batch*sequence", 64, 1)


def test_the_tokens_are_followed_through_the_dispatch() -> None:
    index = load_index(MODEL)
    shapes = ShapeInference(index)
    mapper = AxisMapper(index, shapes, "sequence")
    tokens = "/model/layers.0/mlp/Reshape_output_0"  # [batch*sequence, 32]
    unsqueezed = f"{EXPERTS}/Unsqueeze_output_0"  # [batch*sequence, 1, 32]
    tiled = f"{EXPERTS}/Tile_output_0"
    assert mapper.output_axis(_node(index, f"{EXPERTS}/Unsqueeze"), tokens, 0) == 0
    assert mapper.output_axis(_node(index, f"{EXPERTS}/Tile"), unsqueezed, 0) == 0
    assert mapper.output_axis(_node(index, f"{EXPERTS}/Tile"), unsqueezed, 1) is None
    assert mapper.output_axis(_node(index, f"{EXPERTS}/Flatten"), tiled, 0) == 0


def test_one_hot_keeps_the_indices_axes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Each token's chosen experts [batch, sequence, 2] as rows of 4: [batch, sequence, 2, 4].
    depth = helper.make_tensor("depth", TensorProto.INT64, [], [4])
    values = helper.make_tensor("values", TensorProto.FLOAT, [2], [0.0, 1.0])
    graph = helper.make_graph(
        [helper.make_node("OneHot", ["chosen", "depth", "values"], ["rows"], name="onehot")],
        "one_hot",
        [helper.make_tensor_value_info("chosen", TensorProto.INT64, ["batch", "sequence", 2])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)],
        [depth, values],
    )
    index = GraphIndex(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    mapper = AxisMapper(index, ShapeInference(index), "sequence")
    assert mapper.input_axes(index.nodes[0], 1) == [("chosen", 1)]
    assert mapper.input_axes(index.nodes[0], 2) == [("chosen", 2)]
    assert mapper.input_axes(index.nodes[0], 3) is None
