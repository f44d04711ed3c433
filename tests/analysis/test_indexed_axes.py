"""The axis rules of the ops that read or write by indices along one axis (analysis/axes.py):
ScatterND and GatherND past the axes their indices address, GatherElements and
ScatterElements along every axis but the one they index (and GatherElements along that one
too, by its indices: DeBERTa's relative scores), ArgMax along every axis but the one
it reduces. DeepSeek-V3's exports use the ScatterND and the Elements ops: its K is a new buffer
into which each head's halves are copied (ScatterND), its router picks each token's experts'
weights (GatherElements) and masks each token's groups (ScatterElements); PhiMoE's router picks
each token's expert by ArgMax; the dynamo exporter's Falcon picks its K and V heads out of its
fused QKV by GatherND.

Each rule is shown two ways: what the mapper answers, and onnxruntime running the node on
the slices of the axis it maps, which must give the slices of the whole run.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(node, inputs, initializers=()):  # type: ignore[no-untyped-def]
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info("out", F, None)], list(initializers)
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, feeds):  # type: ignore[no-untyped-def]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _sliced_runs_agree(model, feeds, axes, out_axis, parts=2):  # type: ignore[no-untyped-def]
    """Running on ``parts`` slices of each input's axis (``axes``: input -> axis) and joining
    the outputs along ``out_axis`` gives the whole run."""
    whole = _run(model, feeds)
    pieces = []
    for part in range(parts):
        sliced = dict(feeds)
        for name, axis in axes.items():
            sliced[name] = np.array_split(feeds[name], parts, axis=axis)[part]
        pieces.append(_run(model, sliced))
    return np.array_equal(np.concatenate(pieces, axis=out_axis), whole)


def test_scatter_nd_past_its_indexed_axes_is_position_wise() -> None:
    # DeepSeek's K: buffer [head_dim 6, batch, heads, sequence] (transposed so the head dim
    # leads), the first 4 rows written from updates [4, batch, heads, sequence].
    rows = helper.make_tensor("rows", I64, [4, 1], [0, 1, 2, 3])
    node = helper.make_node("ScatterND", ["buffer", "rows", "half"], ["out"])
    model = _model(
        node,
        [
            helper.make_tensor_value_info("buffer", F, [6, "batch", 2, "sequence"]),
            helper.make_tensor_value_info("half", F, [4, "batch", 2, "sequence"]),
        ],
        [rows],
    )
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "sequence")
    assert mapper.input_axes(index.nodes[0], 3) == [("buffer", 3), ("half", 3)]
    assert mapper.input_axes(index.nodes[0], 1) == [("buffer", 1), ("half", 1)]
    assert mapper.input_axes(index.nodes[0], 0) is None  # the rows it addresses
    rng = np.random.default_rng(0)
    feeds = {
        "buffer": rng.standard_normal((6, 1, 2, 8)).astype(np.float32),
        "half": rng.standard_normal((4, 1, 2, 8)).astype(np.float32),
    }
    assert _sliced_runs_agree(model, feeds, {"buffer": 3, "half": 3}, 3)


def test_scatter_nd_addressing_every_axis_maps_none() -> None:
    # TorchScript's copy into a slice: indices of every axis, the sequence's among them, are
    # values that a slice would have to hold relative to its rank: no rule says so.
    node = helper.make_node("ScatterND", ["buffer", "where", "values"], ["out"])
    model = _model(
        node,
        [
            helper.make_tensor_value_info("buffer", F, ["batch", "sequence", 6]),
            helper.make_tensor_value_info("where", I64, ["batch", "sequence", 4, 3]),
            helper.make_tensor_value_info("values", F, ["batch", "sequence", 4]),
        ],
    )
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "sequence")
    assert [mapper.input_axes(index.nodes[0], axis) for axis in range(3)] == [None] * 3


def test_gather_nd_past_its_indexed_axes_copies_the_data_axes() -> None:
    # The dynamo exporter's Falcon picks a K head group out of its fused QKV, transposed to
    # [4 groups, batch, sequence, 2 kv heads, 16], with indices [[2]]: [1, batch, sequence, 2,
    # 16]. Past the indices' leading axis, the output's axes are the data's from the one
    # indexed on: the sequence is axis 2 of both.
    pick = helper.make_tensor("pick", I64, [1, 1], [2])
    node = helper.make_node("GatherND", ["qkv", "pick"], ["out"])
    model = _model(
        node, [helper.make_tensor_value_info("qkv", F, [4, "batch", "sequence", 2, 16])], [pick]
    )
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "sequence")
    gather = index.nodes[0]
    assert mapper.input_axes(gather, 2) == [("qkv", 2)]
    assert mapper.input_axes(gather, 4) == [("qkv", 4)]
    assert mapper.input_axes(gather, 0) == [("pick", 0)]  # the indices' own rows
    assert mapper.output_axis(gather, "qkv", 2) == 2
    assert mapper.output_axis(gather, "qkv", 0) is None  # the axis it indexes
    rng = np.random.default_rng(0)
    feeds = {"qkv": rng.standard_normal((4, 1, 8, 2, 16)).astype(np.float32)}
    assert _sliced_runs_agree(model, feeds, {"qkv": 2}, 2)


def test_gather_nd_with_batch_dims_maps_none() -> None:
    node = helper.make_node("GatherND", ["data", "where"], ["out"], batch_dims=1)
    model = _model(
        node,
        [
            helper.make_tensor_value_info("data", F, ["batch", 4, "sequence"]),
            helper.make_tensor_value_info("where", I64, ["batch", 1]),
        ],
    )
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "sequence")
    assert [mapper.input_axes(index.nodes[0], axis) for axis in range(2)] == [None] * 2


@pytest.mark.parametrize("op", ["GatherElements", "ScatterElements"])
def test_elements_ops_keep_every_axis_but_the_indexed_one(op: str) -> None:
    # A router's scores [tokens, 4 experts], each token's 2 choices [tokens, 2].
    inputs = ["scores", "choices"] + (["ones"] if op == "ScatterElements" else [])
    node = helper.make_node(op, inputs, ["out"], axis=1)
    values = [
        helper.make_tensor_value_info("scores", F, ["tokens", 4]),
        helper.make_tensor_value_info("choices", I64, ["tokens", 2]),
    ]
    if op == "ScatterElements":
        values.append(helper.make_tensor_value_info("ones", F, ["tokens", 2]))
    model = _model(node, values)
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "tokens")
    assert mapper.input_axes(index.nodes[0], 0) == [(name, 0) for name in inputs]
    # Along the indexed axis a gather reads its indices only (the next test); a scatter writes
    # each element where its index says, so its output's positions are no input's.
    along = [("choices", 1)] if op == "GatherElements" else None
    assert mapper.input_axes(index.nodes[0], 1) == along
    rng = np.random.default_rng(0)
    feeds = {
        "scores": rng.standard_normal((8, 4)).astype(np.float32),
        "choices": np.stack([rng.permutation(4)[:2] for _ in range(8)]).astype(np.int64),
    }
    if op == "ScatterElements":
        feeds["ones"] = np.ones((8, 2), np.float32)
    assert _sliced_runs_agree(model, feeds, dict.fromkeys(inputs, 0), 0)


def test_gather_elements_along_its_indexed_axis_follows_the_indices() -> None:
    # DeBERTa's position-to-content scores: every key's scores against the 2 * span relative
    # positions, [heads, keys, 6], picked for each (key, query) by an index [heads, keys,
    # queries] along the last axis. Along the queries, each output is its own index's pick
    # from the data, which every rank reads whole.
    node = helper.make_node("GatherElements", ["by_position", "index"], ["out"], axis=2)
    model = _model(
        node,
        [
            helper.make_tensor_value_info("by_position", F, [2, "sequence", 6]),
            helper.make_tensor_value_info("index", I64, [2, "sequence", "sequence"]),
        ],
    )
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "sequence")
    assert mapper.input_axes(index.nodes[0], 2) == [("index", 2)]
    rng = np.random.default_rng(0)
    feeds = {
        "by_position": rng.standard_normal((2, 8, 6)).astype(np.float32),
        "index": rng.integers(0, 6, (2, 8, 8)).astype(np.int64),
    }
    assert _sliced_runs_agree(model, feeds, {"index": 2}, 2)


def test_elements_ops_whose_indices_cover_part_of_an_axis_map_none() -> None:
    # Indices [2, 2] into data [tokens, 4]: their rows are not the data's.
    node = helper.make_node("GatherElements", ["scores", "choices"], ["out"], axis=1)
    model = _model(
        node,
        [
            helper.make_tensor_value_info("scores", F, ["tokens", 4]),
            helper.make_tensor_value_info("choices", I64, [2, 2]),
        ],
    )
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "tokens")
    assert mapper.input_axes(index.nodes[0], 0) is None


@pytest.mark.parametrize("keepdims", [1, 0])
def test_arg_max_keeps_every_axis_but_the_one_it_reduces(keepdims: int) -> None:
    # PhiMoE's sparse mixer: each token's expert, ArgMax over [tokens, 4 experts].
    node = helper.make_node("ArgMax", ["scores"], ["out"], axis=-1, keepdims=keepdims)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("scores", F, ["tokens", 4])],
        [helper.make_tensor_value_info("out", I64, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    index = GraphIndex(model)
    shapes = ShapeInference(index)
    assert shapes.shape("out") == (("tokens", 1) if keepdims else ("tokens",))
    mapper = AxisMapper(index, shapes, "tokens")
    assert mapper.input_axes(index.nodes[0], 0) == [("scores", 0)]
    if keepdims:
        assert mapper.input_axes(index.nodes[0], 1) is None
    feeds = {"scores": np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)}
    assert _sliced_runs_agree(model, feeds, {"scores": 0}, 0)
