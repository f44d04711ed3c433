"""Sorting dispatches of a mixture of experts on the ranks' tokens (analysis/selections.py;
issue 27).

JetMoE (its attention heads and its MLP) and transformers 4's GraniteMoE sort every (token,
slot) pair by its expert: a TopK over the whole flattened axis. They read the tokens' rows in
that order (the sorted positions divided by the slots: a GatherND), cut them into the experts'
parts by each expert's count (a Split by sizes the model sums over the tokens) and write each
row back at its position (a ScatterND). On a rank the dispatch runs on the rank's own tokens:
each expert's part on the ranks together holds the rows it holds on one device, each once.
test_lengths_real.py verifies the default plans at 2 and 4 ranks, batch 1 and 2, and counts
their projections on the multi-device model.

TorchScript's traces of the same models keep the counts their example saw (a Split of
constant parts): baked (SC003), tested here on a graph of that form.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import FIXTURES, GOLDEN, gen_plan, run_cli
from expert_rows import BATCH, LENGTH, values_whole_and_on_ranks
from onnx import TensorProto, helper, numpy_helper

from shardcheck import load_index
from shardcheck.analysis.selections import (
    baked_counts,
    describe_baked,
    is_counted_split,
    is_full_sort,
    selected_by,
    selection_counts,
)
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex

REAL = FIXTURES / "real"
# Each layer's mixtures: JetMoE's attention and MLP, GraniteMoE's MLP; 4 experts each.
EXPORTS = {"dynamo_jetmoe_tiny": 2 * 2, "dynamo_granitemoe_tf4": 2}


@pytest.mark.parametrize(("name", "mixtures"), EXPORTS.items())
def test_the_dispatch_is_read_as_a_selection(name: str, mixtures: int) -> None:
    shapes = ShapeInference(load_index(REAL / f"{name}.onnx"))
    index = shapes.index
    # Every mixture splits its sorted rows twice (into and out of the experts) in JetMoE's
    # attention, once in an MLP: at least one counted Split per mixture.
    splits = [node for node in index.nodes if is_counted_split(shapes, node)]
    assert len(splits) >= mixtures
    sorts = [node for node in index.nodes if is_full_sort(shapes, node)]
    assert len(sorts) == mixtures
    # The routers' TopK (k = 2 of 4 experts) sort nothing whole.
    routers = [n for n in index.nodes if n.op_type == "TopK" and not is_full_sort(shapes, n)]
    assert len(routers) == mixtures
    # Each mixture's rows are read at the sorted positions of its sort (a GatherND), cut, and
    # (JetMoE's attention, the MLPs' gated halves) cut again after the experts' first Gemms.
    read = [index.producer_of(split.inputs[0]) for split in splits]
    gathers = [node for node in read if node is not None and node.op_type == "GatherND"]
    assert len(gathers) >= mixtures
    for rows in gathers:
        [selection] = selected_by(shapes, rows.inputs[1])
        assert index.nodes[selection] in sorts
    # The sizes are summed over the tokens (a ReduceSum) for the Splits alone.
    counts = selection_counts(shapes)
    for split in splits:
        assert split.inputs[1] in counts
    sums = [node for node in index.nodes if node.op_type == "ReduceSum"]
    assert sums and all(node.outputs[0] in counts for node in sums)
    assert not counts & {name for node in routers for name in node.outputs}
    assert baked_counts(shapes) == []


@pytest.mark.parametrize("name", EXPORTS)
def test_each_expert_gets_its_rows_on_the_ranks_once(name: str, tmp_path: Path) -> None:
    model = REAL / f"{name}.onnx"
    index = load_index(model)
    shapes = ShapeInference(index)
    splits = [node for node in index.nodes if is_counted_split(shapes, node)]
    parts = [output for node in splits for output in node.outputs]
    whole, per_rank = values_whole_and_on_ranks(model, parts, tmp_path)
    routed = 0
    for part in parts:
        counts = [values[part].shape[0] for values in per_rank]
        # Every (token, slot) routed to this expert, on one rank or the other.
        assert sum(counts) == whole[part].shape[0], part
        routed += whole[part].shape[0]
    # 2 experts of each token (2 x 16 tokens) in each mixture's Split.
    assert routed == 2 * BATCH * LENGTH * len(splits)
    # Each rank's experts run on its own tokens' rows: half of them, as its tokens are half.
    for values in per_rank:
        assert sum(values[part].shape[0] for part in parts) == routed // 2


def _sorting_dispatch(sizes: str) -> onnx.ModelProto:
    """x [S, 4] -> each position's expert (ArgMax of a router's 2 scores, as TopK k=1 picks) ->
    a sort of the S positions by expert (TopK, k = S) -> the rows of x in that order (Gather at
    the positions divided by 1 slot) -> a Split into the 2 experts' parts, by ``sizes``: the
    constants [3, 3] a trace writes, or each expert's count summed over the positions."""
    nodes = [
        helper.make_node("MatMul", ["x", "router"], ["scores"]),
        helper.make_node("TopK", ["scores", "one"], ["best", "expert"], axis=1),
        helper.make_node("Reshape", ["expert", "flat"], ["experts"]),
        helper.make_node("Shape", ["experts"], ["length"]),
        helper.make_node("TopK", ["experts", "length"], ["sorted", "order"], axis=0, largest=0),
        helper.make_node("Div", ["order", "one"], ["token"]),
        helper.make_node("Gather", ["x", "token"], ["rows"], axis=0),
    ]
    initializers = [
        numpy_helper.from_array(np.array([[1, -1], [-1, 1], [1, 0], [0, 1]], np.float32), "router"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([-1], np.int64), "flat"),
    ]
    if sizes == "constant":
        initializers.append(numpy_helper.from_array(np.array([3, 3], np.int64), "sizes"))
        parts = [
            helper.make_tensor_value_info(f"part{i}", TensorProto.FLOAT, [3, 4]) for i in (0, 1)
        ]
    else:
        nodes += [
            helper.make_node("OneHot", ["experts", "depth", "off_on"], ["routed"], axis=-1),
            helper.make_node("ReduceSum", ["routed", "zero"], ["summed"], keepdims=0),
            helper.make_node("Cast", ["summed"], ["sizes"], to=TensorProto.INT64),
        ]
        initializers += [
            numpy_helper.from_array(np.array([2], np.int64), "depth"),
            numpy_helper.from_array(np.array([0, 1], np.float32), "off_on"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
        ]
        # As the dynamo exporter declares the parts: each of an unbacked count.
        parts = [
            helper.make_tensor_value_info(f"part{i}", TensorProto.FLOAT, [f"u{i}", 4])
            for i in (0, 1)
        ]
    nodes.append(helper.make_node("Split", ["rows", "sizes"], ["part0", "part1"], axis=0))
    graph = helper.make_graph(
        nodes,
        "sorting_dispatch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["sequence", 4])],
        parts,
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_split_of_sorted_rows_into_constant_parts_is_baked() -> None:
    model = _sorting_dispatch("constant")
    shapes = ShapeInference(GraphIndex(model))
    [(split, selection)] = baked_counts(shapes)
    assert (split.op_type, selection.op_type) == ("Split", "TopK")
    assert is_full_sort(shapes, selection)
    message = describe_baked(shapes, [(split, selection)])
    assert "counts of the tokens TopK" in message and "dynamo" in message
    assert "wrong results" in message
    # What the warning says: at inputs that route other counts, the second expert's part holds
    # tokens of the first (no error); at another length the Split fails.
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    balanced = np.array([[1, 0, 0, 0]] * 3 + [[0, 1, 0, 0]] * 3, np.float32)
    first, second = session.run(None, {"x": balanced})
    np.testing.assert_array_equal(first, balanced[:3])
    np.testing.assert_array_equal(second, balanced[3:])
    to_the_first = np.array([[1, 0, 0, 0]] * 6, np.float32)
    _, second = session.run(None, {"x": to_the_first})
    np.testing.assert_array_equal(second, to_the_first[3:])  # routed to the first expert
    with pytest.raises(Exception, match="Split"):
        session.run(None, {"x": to_the_first[:4]})


def test_a_split_by_counted_sizes_is_followed_not_baked() -> None:
    model = _sorting_dispatch("counted")
    shapes = ShapeInference(GraphIndex(model))
    assert baked_counts(shapes) == []
    [split] = [node for node in shapes.index.nodes if node.op_type == "Split"]
    assert is_counted_split(shapes, split)
    # The sizes and what sums them are counts; the experts sorted are not (the sort reads them).
    assert {"sizes", "summed", "routed"} <= selection_counts(shapes)
    assert "experts" not in selection_counts(shapes)
    # The parts are each expert's rows at any routing: 4 and 2, then 6 and 0.
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([[1, 0, 0, 0]] * 4 + [[0, 1, 0, 0]] * 2, np.float32)
    first, second = session.run(None, {"x": x})
    np.testing.assert_array_equal(first, x[:4])
    np.testing.assert_array_equal(second, x[4:])
    assert [part.shape for part in session.run(None, {"x": x[:1].repeat(6, 0)})] == [
        (6, 4),
        (0, 4),
    ]


def test_a_top_k_of_fewer_than_its_axis_sorts_nothing_whole() -> None:
    shapes = ShapeInference(GraphIndex(_sorting_dispatch("counted")))
    router, sort = [node for node in shapes.index.nodes if node.op_type == "TopK"]
    assert not is_full_sort(shapes, router)
    assert is_full_sort(shapes, sort)
    assert [shapes.index.nodes[at] for at in selected_by(shapes, "token")] == [sort]


def test_explain_counts_the_experts_rows_in_all() -> None:
    # JetMoE at length 64, batch 1 (hidden 32; K and V 2 heads of 8 each; each attention
    # expert 2 query heads of 8; MLP experts of intermediate 64, gated: 128 wide in), per token
    # and layer: 2 routers 32 -> 4 (2·32·4 each), K and V 32 -> 32 (2·32·32), and for each of a
    # token's 2 experts the attention's 32 -> 16 and 16 -> 32 (2·32·16 each) and the MLP's
    # 32 -> 128 and 64 -> 32. Each expert's rows are known at run time only; their total, 2 per
    # token, is what the FLOPs add up to.
    routers, kv = 2 * (2 * 32 * 4), 2 * 32 * 32
    per_expert = 2 * (2 * 32 * 16) + 2 * 32 * 128 + 2 * 64 * 32
    per_token = routers + kv + 2 * per_expert
    model = REAL / "dynamo_jetmoe_tiny.onnx"
    extension = GOLDEN / "real" / "dynamo_jetmoe_tiny.shardcheck.json"
    result = run_cli("explain", model, extension, "--seq-len", "64", "--format", "json")
    assert result.exit_code == 0, result.stderr
    flops = json.loads(result.stdout)["plan"]["flops"]
    assert flops["uncounted_projections"] == 0
    assert flops["by_class"]["projections"] == {
        "on_slices": per_token * 2 * 64,
        "whole": 0,
        "share_on_slices": 1.0,
    }


def test_a_sort_whose_values_are_read_selects_nothing() -> None:
    # A rank's sorted values are no slice of the whole's: only a sort read for its order is a
    # selection of the rank's positions.
    model = _sorting_dispatch("counted")
    model.graph.output.append(helper.make_tensor_value_info("sorted", TensorProto.INT64, None))
    shapes = ShapeInference(GraphIndex(model))
    assert not any(is_full_sort(shapes, node) for node in shapes.index.nodes)
    assert selected_by(shapes, "token") == set()


@pytest.mark.parametrize("name", EXPORTS)
def test_the_buffers_the_rows_go_back_into_are_built_on_each_rank(
    name: str, tmp_path: Path
) -> None:
    # The zeros each ScatterND writes its rows back into: an Expand of a constant of one
    # element, sized by the tokens. A rank builds them at its own length (the extension gives
    # each its rank's length) rather than every rank building them whole and receiving its
    # slice: none is scattered.
    model = REAL / f"{name}.onnx"
    index = load_index(model)
    fills = {
        node.name: node.outputs[0]
        for node in index.nodes
        if node.op_type == "Expand"
        and index.constant_tensor(node.inputs[0]) is not None
        and any(user.op_type == "ScatterND" for user in index.consumers_of(node.outputs[0]))
    }
    assert fills
    _, extension = gen_plan(model, tmp_path)
    assert extension is not None
    document = json.loads(extension.read_text())
    scattered = {tensor["name"] for tensor in document["hints"]["inputs"]}
    assert not scattered & set(fills.values())
    assert set(fills) <= set(document["rank_length"])
