"""graph/build.py builds the messages onnx.helper builds, byte for byte: the multi-device models
that gen counts and shard writes are made with it, without importing onnx."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from shardcheck.graph import build


@pytest.mark.parametrize(
    "attributes",
    [
        {},
        {"axis": 0},
        {"perm": [0, 2, 1, 3]},
        {"perm": (1, 0)},
        {"scale": 0.125, "is_causal": 1, "nb_rank": 4},
        {"collective_operation": "REDUCE_SCATTER", "reduce_op": "sum", "root": 0},
        {"value": helper.make_tensor("v", onnx.TensorProto.INT64, [2], [3, -1])},
        {"axis": None, "keepdims": 1},
    ],
)
def test_a_node_is_the_one_onnx_helper_makes(attributes: dict[str, object]) -> None:
    ours = build.make_node("Op", ["a", "", "b"], ["c"], name="n", **attributes)  # type: ignore[arg-type]
    theirs = helper.make_node("Op", ["a", "", "b"], ["c"], name="n", **attributes)
    assert ours.SerializeToString() == theirs.SerializeToString()


def test_an_unnamed_node_in_a_domain_is_the_one_onnx_helper_makes() -> None:
    ours = build.make_node("DistCollective", ["x"], ["y"], domain="trt")
    theirs = helper.make_node("DistCollective", ["x"], ["y"], domain="trt")
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert not ours.HasField("name")


def test_an_empty_ints_attribute_is_the_one_onnx_helper_makes() -> None:
    # DistCollective's groups are empty by default: onnx.helper needs to be told their type.
    ours = build.make_attribute("groups", [])
    theirs = helper.make_attribute("groups", [], attr_type=onnx.AttributeProto.INTS)
    assert ours.SerializeToString() == theirs.SerializeToString()


@pytest.mark.parametrize("values", [[], [5], [1, -2, 2**40]])
def test_an_int64_tensor_is_the_one_onnx_helper_makes(values: list[int]) -> None:
    ours = build.int64_tensor("t", [len(values)], values)
    theirs = helper.make_tensor("t", onnx.TensorProto.INT64, [len(values)], values)
    assert ours.SerializeToString() == theirs.SerializeToString()


def test_a_value_info_without_a_shape_is_the_one_onnx_helper_makes() -> None:
    ours = build.tensor_value_info("x", onnx.TensorProto.FLOAT16)
    theirs = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, None)
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert not ours.type.tensor_type.HasField("shape")
