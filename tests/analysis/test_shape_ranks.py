"""Class 6 of issue 28: the shape rules never lose a rank that onnx's own shape inference knows.

Where ``onnx.shape_inference.infer_shapes(model, data_prop=True)`` gives a tensor a rank,
shardcheck's rules (analysis/shapes.py, shape_rules.py) must give it the same one, never an
unknown: a lost rank made gen write ``rank: null``, which the CP simulation then refuses."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURE_MODELS
from onnx import TensorProto, helper, shape_inference

from shardcheck import load_index
from shardcheck.analysis.shapes import ShapeInference


def onnx_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank onnx infers (with data propagation) of each tensor it gives a shape."""
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    graph = inferred.graph
    return {
        value.name: len(value.type.tensor_type.shape.dim)
        for value in [*graph.value_info, *graph.output]
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")
    }


def rank_disagreements(path: Path) -> list[tuple[str, str, int | None, int]]:
    """(op, tensor, shardcheck's rank, onnx's rank) of every node output they differ on."""
    expected = onnx_ranks(onnx.load(str(path)))
    index = load_index(path)
    shapes = ShapeInference(index)
    return [
        (node.op_type, output, shapes.rank(output), expected[output])
        for node in index.nodes
        for output in node.outputs
        if output in expected and shapes.rank(output) != expected[output]
    ]


@pytest.mark.parametrize("path", FIXTURE_MODELS, ids=lambda path: path.stem)
def test_every_rank_onnx_infers_is_the_rank_the_rules_give(path: Path) -> None:
    assert rank_disagreements(path) == []


def save(
    tmp_path: Path,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_scatter_nd_keeps_its_datas_shape(tmp_path: Path) -> None:
    # DeepSeek-V3's MLA (TorchScript) writes its rotary half of K into a copy with ScatterND.
    path = save(
        tmp_path,
        [
            helper.make_node("ScatterND", ["x", "indices", "updates"], ["written"], name="write"),
            helper.make_node("Transpose", ["written"], ["y"], name="t", perm=[0, 2, 1]),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 8]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, [1, 1]),
            helper.make_tensor_value_info("updates", TensorProto.FLOAT, [1, "sequence", 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    shapes = ShapeInference(load_index(path))
    assert shapes.shape("written") == ("batch", "sequence", 8)
    assert shapes.shape("y") == ("batch", 8, "sequence")
    assert rank_disagreements(path) == []


def test_a_reshape_to_a_concat_of_known_length_has_that_rank(tmp_path: Path) -> None:
    # x declares no shape: its dims are unknown, but Shape(x) is a vector, its first value a
    # scalar, and the Concat of three one-value vectors has length 3: the Reshape has rank 3.
    one = helper.make_tensor("one", TensorProto.INT64, [1], [-1])
    four = helper.make_tensor("four", TensorProto.INT64, [1], [4])
    zero = helper.make_tensor("zero", TensorProto.INT64, [], [0])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    path = save(
        tmp_path,
        [
            helper.make_node("Shape", ["x"], ["shape"], name="shape"),
            helper.make_node("Gather", ["shape", "zero"], ["batch"], name="first"),
            helper.make_node("Unsqueeze", ["batch", "axes"], ["batch_1"], name="unsqueeze"),
            helper.make_node("Concat", ["batch_1", "one", "four"], ["target"], name="cat", axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [one, four, zero, axes],
    )
    shapes = ShapeInference(load_index(path))
    assert [shapes.rank(t) for t in ("shape", "batch", "batch_1", "target", "y")] == [1, 0, 1, 1, 3]
    assert shapes.shape("target") == (3,)
    assert rank_disagreements(path) == []


def test_a_concat_with_a_part_of_unknown_length_keeps_its_rank(tmp_path: Path) -> None:
    path = save(
        tmp_path,
        [
            helper.make_node("Shape", ["unknown"], ["dims"], name="shape"),
            helper.make_node("Concat", ["known", "dims"], ["both"], name="cat", axis=0),
        ],
        [
            helper.make_tensor_value_info("known", TensorProto.INT64, [2]),
            helper.make_tensor_value_info("unknown", TensorProto.FLOAT, None),
        ],
        [helper.make_tensor_value_info("both", TensorProto.INT64, None)],
    )
    assert ShapeInference(load_index(path)).shape("both") == (None,)
    assert rank_disagreements(path) == []


def test_top_k_and_one_hot_as_a_mixture_of_experts_router_writes_them(tmp_path: Path) -> None:
    # GPT-OSS's router: the top 2 of 4 experts per token, then their one-hot rows.
    k = helper.make_tensor("k", TensorProto.INT64, [1], [2])
    depth = helper.make_tensor("depth", TensorProto.INT64, [], [4])
    values = helper.make_tensor("values", TensorProto.FLOAT, [2], [0.0, 1.0])
    path = save(
        tmp_path,
        [
            helper.make_node("TopK", ["logits", "k"], ["top", "chosen"], name="topk", axis=-1),
            helper.make_node("OneHot", ["chosen", "depth", "values"], ["rows"], name="onehot"),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 4])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)],
        [k, depth, values],
    )
    shapes = ShapeInference(load_index(path))
    assert shapes.shape("top") == shapes.shape("chosen") == ("batch", "sequence", 2)
    assert shapes.shape("rows") == ("batch", "sequence", 2, 4)
    assert rank_disagreements(path) == []
