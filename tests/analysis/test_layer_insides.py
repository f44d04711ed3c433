"""Axes inside the attention layers (analysis/layer_insides.py): the Reshapes of the scores with
their queries' axis, and the Slices of a table along the keys that the scores read.

Checked on the two exports that need them (the dynamo exporter's Bloom reshapes its scores by
the mask's whole length; TorchScript's MPT slices its ALiBi bias by K's length before the
gather), and on a hand-built head whose bias table is sliced along the keys, or along the
queries, before the scores add it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, checked_model
from onnx import TensorProto
from onnx import helper as oh

from shardcheck import load_index
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.layer_insides import key_slices, mask_broadcasts, query_axes
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex

REAL = FIXTURES / "real"


def _axes_of(index: GraphIndex):  # type: ignore[no-untyped-def]
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    return query_axes(index, shapes, layers), key_slices(index, shapes, layers)


def test_bloom_scores_reshapes_hold_the_queries_where_their_shapes_say() -> None:
    # Per layer: [4*batch, S, S] -> [batch, 4, S, S] (queries on axis 2), and back (axis 1).
    queries, keys = _axes_of(load_index(REAL / "dynamo_bloom_tiny.onnx"))
    assert sorted(queries.values()) == [1, 1, 2, 2]
    assert keys == frozenset()


def test_torchscript_mpt_slices_its_bias_along_the_keys() -> None:
    queries, keys = _axes_of(load_index(REAL / "ts_mpt_tiny.onnx"))
    assert keys == {"/model/blocks.0/attn/Slice_3", "/model/blocks.1/attn/Slice_3"}
    assert queries == {}


def test_dynamo_xlm_broadcasts_its_padding_mask_along_the_queries() -> None:
    # Both layers read one mask: attention_mask == 0, viewed [batch, 1, 1, keys] and expanded
    # to the scores' [batch, 2 heads, queries, keys] (read off the graph: the Where of each
    # layer's scores takes it as its condition). Its queries are on axis 2.
    index = load_index(REAL / "dynamo_xlm_tiny.onnx")
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    (mask,) = {mask for layer in layers for mask in layer.masks}
    producer = index.producer_of(mask)
    assert producer is not None and producer.op_type == "Expand"
    assert shapes.shape(producer.inputs[0]) == ("batch", 1, 1, "sequence")
    assert mask_broadcasts(index, shapes, layers) == {producer.name: 2}


def _expanded_mask_head(bias_rows: str | int) -> GraphIndex:
    """One head over x [S, 4] whose scores [S, S] add a mask expanded from ``bias``
    [bias_rows, S] to their shape."""
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), f"W_{p}")
        for p in "qkv"
    ]
    nodes = [
        *(oh.make_node("MatMul", ["x", f"W_{p}"], [p]) for p in "qkv"),
        oh.make_node("Transpose", ["k"], ["k_t"], perm=[1, 0]),
        oh.make_node("MatMul", ["q", "k_t"], ["scores"]),
        oh.make_node("Shape", ["scores"], ["scores_shape"]),
        oh.make_node("Expand", ["bias", "scores_shape"], ["mask"], name="expand_mask"),
        oh.make_node("Add", ["scores", "mask"], ["masked"]),
        oh.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "head",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", 4]),
            oh.make_tensor_value_info("bias", TensorProto.FLOAT, [bias_rows, "seq"]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 4])],
        weights,
    )
    return GraphIndex(checked_model(graph, opset=17))


@pytest.mark.parametrize(("bias_rows", "expected"), [(1, {"expand_mask": 0}), ("seq", {})])
def test_only_a_mask_of_one_row_is_broadcast_along_the_queries(
    bias_rows: str | int, expected: dict[str, int]
) -> None:
    # One row for every query: the Expand makes the rows. A row per query: they differ, and
    # a rank needs its own of the bias itself.
    index = _expanded_mask_head(bias_rows)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    assert [layer.masks for layer in layers] == [("mask",)]
    assert mask_broadcasts(index, shapes, layers) == expected


def _biased_head(outer_axis: int) -> onnx.ModelProto:
    """One head over x [1, S, 4]; a [64, 64] bias table sliced to [:S] along axis 1 - outer
    and then along ``outer_axis``, the outer Slice read by the scores' Add."""
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), name)
        for name in ("W_q", "W_k", "W_v")
    ]
    table = onnx.numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "T")
    ints = {"zero": [0], "inner": [1 - outer_axis], "outer": [outer_axis]}
    constants = [oh.make_tensor(k, TensorProto.INT64, [1], v) for k, v in ints.items()]
    nodes = [
        *(oh.make_node("MatMul", ["x", f"W_{p}"], [p]) for p in "qkv"),
        oh.make_node("Shape", ["k"], ["length"], start=1, end=2),
        oh.make_node("Slice", ["T", "zero", "length", "inner"], ["half"], name="inner_slice"),
        oh.make_node("Slice", ["half", "zero", "length", "outer"], ["bias"], name="outer_slice"),
        oh.make_node("Transpose", ["k"], ["kT"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "kT"], ["scores"]),
        oh.make_node("Add", ["scores", "bias"], ["biased"]),
        oh.make_node("Softmax", ["biased"], ["probs"], axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "biased_head",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, "sequence", 4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, "sequence", 4])],
        [*weights, table, *constants],
    )
    return checked_model(graph)


@pytest.mark.parametrize(("outer_axis", "listed"), [(1, {"outer_slice"}), (0, set())])
def test_only_a_slice_along_the_keys_is_one(outer_axis: int, listed: set[str]) -> None:
    # Aligned right against the scores [1, S, S], the table's axis 1 is the keys', its axis 0
    # the queries'.
    _, keys = _axes_of(GraphIndex(_biased_head(outer_axis)))
    assert keys == listed
