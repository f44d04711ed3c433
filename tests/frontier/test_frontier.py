"""The CP frontier on small hand-made graphs, for the cases the real exports do not reach."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.inliner
import pytest
from conftest import FIXTURES
from onnx import TensorProto
from onnx import helper as oh

from shardcheck import GenOptions, generate, simulate
from shardcheck.analysis.axes import AxisMapper, _blocks
from shardcheck.analysis.detect import AttentionLayer, detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.frontier.exactness import _without_sequence
from shardcheck.frontier.region import Region
from shardcheck.frontier.result import Frontier
from shardcheck.frontier.search import data_derived, find_frontier
from shardcheck.frontier.sliced import SlicedTest
from shardcheck.frontier.sources import ShapeSources
from shardcheck.frontier.tensor_ids import TensorIds
from shardcheck.frontier.whole import must_be_whole
from shardcheck.graph.index import Dim, GraphIndex, Node
from shardcheck.graph.loader import load_index
from shardcheck.graph.ops import SHAPE_OPS

SEQ = "sequence_length"
REAL = FIXTURES / "real"
REAL_NAMES = sorted(path.name for path in REAL.glob("*.onnx"))


def _opset17_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """``graph`` as a model of the default domain, opset 17 (IR version 8, which onnxruntime
    reads)."""
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _attention_whose_output_also_feeds_a_position_wise_op() -> onnx.ModelProto:
    nodes = [
        oh.make_node("MatMul", ["q", "k"], ["scores"], name="mm1"),
        oh.make_node("Softmax", ["scores"], ["probs"], name="sm", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["out"], name="mm2"),
        oh.make_node("Relu", ["out"], ["activated"], name="relu"),
    ]
    graph = oh.make_graph(
        nodes,
        "attention_output_read_twice",
        [
            oh.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", SEQ, 16]),
            oh.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", 16, SEQ]),
            oh.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", SEQ, 16]),
        ],
        [
            oh.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", SEQ, 16]),
            oh.make_tensor_value_info("activated", TensorProto.FLOAT, ["batch", SEQ, 16]),
        ],
    )
    return _opset17_model(graph)


def _frontier_of(model: onnx.ModelProto) -> tuple[GraphIndex, Frontier]:
    index = GraphIndex(model)
    shapes = ShapeInference(index)
    return index, find_frontier(index, shapes, detect_attention(index, shapes))


def test_a_gathered_output_that_also_feeds_position_wise_ops_is_warned_about_once() -> None:
    _, frontier = _frontier_of(_attention_whose_output_also_feeds_a_position_wise_op())
    assert [(t.name, t.seq_len_idx) for t in frontier.outputs] == [("out", 1), ("activated", 1)]
    about_out = [w for w in frontier.warnings if w.startswith("out is gathered")]
    assert about_out == [
        "out is gathered (a graph output) but also feeds position-wise ops, which would then "
        "get the whole sequence; CP may not be exact"
    ]


def _simulation_is_exact(
    model: onnx.ModelProto, index: GraphIndex, tmp_path: Path, ranks: int = 2
) -> bool:
    """Whether CP on ``ranks`` ranks with gen's default hints matches one device."""
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    hints = generate(index, GenOptions()).hints
    return simulate(path, hints, ranks=ranks, seq_len=8).ok


def _scores_reshaped_with_the_length_of(
    length_of: str, axis: int, queries_of: str = "q"
) -> onnx.ModelProto:
    """x -> Q, K, V projections; the scores are reshaped (to their own shape) with the batch of
    Q, the query length of ``queries_of`` and the key length read from axis ``axis`` of
    ``length_of``, as BART-style exports do. ``m``, a graph input, is read only for its length."""
    weights = [
        oh.make_tensor(name, TensorProto.FLOAT, [8, 8], [0.01 * (i % 7) for i in range(64)])
        for name in ("wq", "wk", "wv")
    ]
    axes = [oh.make_tensor(f"i{n}", TensorProto.INT64, [1], [n]) for n in (0, 1, 2)]
    nodes = [
        oh.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        oh.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
        oh.make_node("MatMul", ["x", "wv"], ["v"], name="v_proj"),
        oh.make_node("Transpose", ["k"], ["k_t"], name="k_t", perm=[0, 2, 1]),
        oh.make_node("Relu", ["k"], ["k_copy"], name="k_copy"),
        oh.make_node("MatMul", ["q", "k_t"], ["scores"], name="scores"),
        oh.make_node("Shape", ["q"], ["q_shape"], name="q_shape"),
        oh.make_node("Shape", [queries_of], ["query_shape"], name="query_shape"),
        oh.make_node("Shape", [length_of], ["key_shape"], name="key_shape"),
        oh.make_node("Gather", ["q_shape", "i0"], ["batch"], name="batch", axis=0),
        oh.make_node("Gather", ["query_shape", "i1"], ["queries"], name="queries", axis=0),
        oh.make_node("Gather", ["key_shape", f"i{axis}"], ["keys"], name="keys", axis=0),
        oh.make_node("Concat", ["batch", "queries", "keys"], ["target"], name="target", axis=0),
        oh.make_node("Reshape", ["scores", "target"], ["reshaped"], name="reshape_scores"),
        oh.make_node("Softmax", ["reshaped"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"], name="context"),
    ]
    graph = oh.make_graph(
        nodes,
        "scores_reshaped",
        [
            oh.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", SEQ, 8][:rank])
            for name, rank in (("x", 3), ("m", 2))
            if name == "x" or "m" in (queries_of, length_of)
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=[*weights, *axes],
    )
    return _opset17_model(graph)


@pytest.mark.parametrize(("length_of", "axis", "warned"), [("k", 1, True), ("k_t", 2, False)])
def test_scores_sized_by_the_length_of_k_before_its_gather_are_warned_of(
    length_of: str, axis: int, warned: bool, tmp_path: Path
) -> None:
    model = _scores_reshaped_with_the_length_of(length_of, axis)
    index, frontier = _frontier_of(model)
    warning = (
        "no exact cut inside layer scores: reshape_scores is sized along the keys by the length "
        "of k, which each rank holds a slice of before K and V are gathered; CP may not be exact"
    )
    assert (warning in frontier.warnings) is warned, frontier.warnings
    # The simulation agrees: K's local length makes the reshape fail on every rank; the
    # length of the K the layer gathers (k_t) is the whole one.
    assert _simulation_is_exact(model, index, tmp_path) is not warned


@pytest.mark.parametrize(
    ("length_of", "axis", "queries_of", "held"),
    [
        # The query length of a whole tensor next to each rank's slice of the scores.
        ("k_t", 2, "m", "m, which every rank holds whole"),
        # The key length of a copy of K off the walk: each rank's own (MPT's ALiBi bias).
        ("k_copy", 1, "q", "k_copy, which each rank holds a slice of"),
    ],
)
def test_scores_sized_by_the_length_of_a_tensor_off_the_region_are_warned_of(
    length_of: str, axis: int, queries_of: str, held: str, tmp_path: Path
) -> None:
    model = _scores_reshaped_with_the_length_of(length_of, axis, queries_of=queries_of)
    index, frontier = _frontier_of(model)
    assert (
        f"no exact cut inside layer scores: reshape_scores is sized by the length of {held}; "
        "CP may not be exact"
    ) in frontier.warnings, frontier.warnings
    assert not _simulation_is_exact(model, index, tmp_path)


def _scores_of(
    x: str, layer: int | None = None
) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """Q, K and V projections of ``x`` (8 features) and the scores q @ k_t, with their
    weights: tensors q, k, v, k_t and scores, suffixed with ``layer`` when given."""
    n = "" if layer is None else str(layer)
    shift = layer or 0
    weights = [
        oh.make_tensor(
            f"{name}{n}",
            TensorProto.FLOAT,
            [8, 8],
            [0.05 * ((i * (j + shift)) % 7 - 3) for i in range(64)],
        )
        for j, name in ((3, "wq"), (4, "wk"), (5, "wv"))
    ]
    nodes = [
        oh.make_node("MatMul", [x, f"wq{n}"], [f"q{n}"], name=f"q_proj{n}"),
        oh.make_node("MatMul", [x, f"wk{n}"], [f"k{n}"], name=f"k_proj{n}"),
        oh.make_node("MatMul", [x, f"wv{n}"], [f"v{n}"], name=f"v_proj{n}"),
        oh.make_node("Transpose", [f"k{n}"], [f"k_t{n}"], name=f"k_t{n}", perm=[0, 2, 1]),
        oh.make_node("MatMul", [f"q{n}", f"k_t{n}"], [f"scores{n}"], name=f"scores{n}"),
    ]
    return weights, nodes


def _window_mask_sliced_from_row(queries_of: str) -> onnx.ModelProto:
    """A layer whose mask rows are sliced from a constant local-window mask (1 where a query
    sees a key) from row ``len(keys) - len(queries)`` to ``len(keys)``, as TorchScript's
    GPT-Neo does: the keys' length is read from the K the layer gathers (k_t), the queries'
    from ``queries_of`` (q: its query length; k_t: its key length, so the first row is 0)."""
    weights, scores = _scores_of("x")
    window = [1.0 if 0 <= r - c < 3 else 0.0 for r in range(16) for c in range(16)]
    constants = [
        *(oh.make_tensor(f"i{n}", TensorProto.INT64, [1], [n]) for n in (0, 1, 2)),
        oh.make_tensor("window", TensorProto.FLOAT, [16, 16], window),
        oh.make_tensor("masked_out", TensorProto.FLOAT, [], [-1e4]),
    ]
    query_axis = "i2" if queries_of == "k_t" else "i1"
    nodes = [
        *scores,
        oh.make_node("Shape", ["k_t"], ["key_shape"], name="key_shape"),
        oh.make_node("Gather", ["key_shape", "i2"], ["keys"], name="keys", axis=0),
        oh.make_node("Shape", [queries_of], ["query_shape"], name="query_shape"),
        oh.make_node("Gather", ["query_shape", query_axis], ["queries"], name="queries", axis=0),
        oh.make_node("Sub", ["keys", "queries"], ["first_row"], name="first_row"),
        oh.make_node("Slice", ["window", "first_row", "keys", "i0"], ["rows"], name="rows"),
        oh.make_node("Slice", ["rows", "i0", "keys", "i1"], ["mask"], name="mask"),
        oh.make_node("Cast", ["mask"], ["seen"], name="seen", to=TensorProto.BOOL),
        oh.make_node("Where", ["seen", "scores", "masked_out"], ["masked"], name="masked"),
        oh.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"], name="context"),
    ]
    graph = oh.make_graph(
        nodes,
        "window_mask",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=[*weights, *constants],
    )
    return _opset17_model(graph)


def _mask_of_unknown_shape() -> onnx.ModelProto:
    """A mask [batch, S, S] that blocks the first query's first key, made by ScatterND into
    zeros whose shape gen does not infer (it passes through a BitShift by 0, which no shape
    rule follows). It is sized from x: each rank that makes it from its slice of x makes it
    for its own first query."""
    weights, scores = _scores_of("x")
    constants = [
        *(oh.make_tensor(f"i{n}", TensorProto.INT64, [1], [n]) for n in (0, 1, 2)),
        oh.make_tensor("first", TensorProto.INT64, [1, 3], [0, 0, 0]),
        oh.make_tensor("blocked", TensorProto.FLOAT, [1], [-1e4]),
        oh.make_tensor("no_shift", TensorProto.UINT64, [1], [0]),
    ]
    zeros = oh.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    nodes = [
        *scores,
        oh.make_node("Shape", ["x"], ["x_shape"], name="x_shape"),
        oh.make_node("Slice", ["x_shape", "i0", "i2"], ["batch_seq"], name="batch_seq"),
        oh.make_node("Slice", ["x_shape", "i1", "i2"], ["seq"], name="seq"),
        oh.make_node("Concat", ["batch_seq", "seq"], ["mask_dims"], name="mask_dims", axis=0),
        oh.make_node("Cast", ["mask_dims"], ["unsigned"], name="unsigned", to=TensorProto.UINT64),
        oh.make_node(
            "BitShift", ["unsigned", "no_shift"], ["shifted"], name="shifted", direction="LEFT"
        ),
        oh.make_node("Cast", ["shifted"], ["mask_shape"], name="mask_shape", to=TensorProto.INT64),
        oh.make_node("ConstantOfShape", ["mask_shape"], ["zeros"], name="zeros", value=zeros),
        oh.make_node("ScatterND", ["zeros", "first", "blocked"], ["mask"], name="mask"),
        oh.make_node("Add", ["scores", "mask"], ["masked"], name="masked"),
        oh.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"], name="context"),
    ]
    graph = oh.make_graph(
        nodes,
        "scattered_mask",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=[*weights, *constants],
    )
    return _opset17_model(graph)


def test_a_mask_of_unknown_shape_is_warned_of(tmp_path: Path) -> None:
    model = _mask_of_unknown_shape()
    index = GraphIndex(model)
    warnings = generate(index, GenOptions()).warnings
    assert any(
        "the shape of mask, which layer scores combines with its scores, is not fully known" in w
        for w in warnings
    ), warnings
    # The warning is true: each rank blocks its own first query.
    for ranks in (2, 4):
        assert not _simulation_is_exact(model, index, tmp_path, ranks)


@pytest.mark.parametrize(("queries_of", "warned"), [("q", True), ("k_t", False)])
def test_a_cut_computed_from_the_length_of_a_scattered_q_is_warned_of(
    queries_of: str, warned: bool, tmp_path: Path
) -> None:
    # The mask is computed whole and scattered along its rows. Q is scattered too (it is
    # read whole by nothing else), so the Shape reads each rank's slice of it: the rows start
    # at len(keys) - len(local queries) on every rank. K is gathered: its length is whole.
    model = _window_mask_sliced_from_row(queries_of)
    index, frontier = _frontier_of(model)
    assert ("seen", 0) in {(t.name, t.seq_len_idx) for t in frontier.inputs}
    warning = (
        "no exact cut at seen: it is computed whole and scattered, but query_shape gives it the "
        "length of q, which each rank holds a slice of; CP may not be exact"
    )
    assert (warning in frontier.warnings) is warned, frontier.warnings
    for ranks in (2, 4):
        assert _simulation_is_exact(model, index, tmp_path, ranks) is not warned


@pytest.mark.parametrize(
    ("value", "without"),
    [
        (("batch",), True),
        ((4, "batch"), True),
        ((SEQ,), False),
        ((f"2*{SEQ}",), False),
        ((f"{SEQ}_padded",), True),
        ((None,), False),
        (None, False),
    ],
)
def test_a_length_holds_the_sequence_unless_its_value_shows_otherwise(
    value: tuple[Dim, ...] | None, without: bool
) -> None:
    assert _without_sequence(value, SEQ) is without
    assert not _without_sequence(value, None)  # the sequence dim unknown: it may be anywhere


def _attention_beside_a_running_sum(layers: int, *, transposed: bool) -> onnx.ModelProto:
    """``layers`` blocks, each: attention over its input h, and beside it a CumSum of h along
    the sequence (it mixes positions, so h stays whole and Q, K and V are cut); the two are
    concatenated, then projected back to 8 features, the next block's input. ``transposed``:
    the sum is taken over a transposed copy of h and transposed back (as ConvBERT convolves
    its input)."""
    nodes: list[onnx.NodeProto] = []
    initializers = [
        oh.make_tensor("seq_axis", TensorProto.INT64, [], [1]),
        oh.make_tensor("last_axis", TensorProto.INT64, [], [2]),
    ]
    h = "x"
    for n in range(layers):
        weights, scores = _scores_of(h, layer=n)
        out = [0.04 * ((i * (n + 2)) % 5 - 2) for i in range(128)]
        initializers += [*weights, oh.make_tensor(f"wo{n}", TensorProto.FLOAT, [16, 8], out)]
        nodes += [
            *scores,
            oh.make_node("Softmax", [f"scores{n}"], [f"probs{n}"], name=f"softmax{n}", axis=-1),
            oh.make_node("MatMul", [f"probs{n}", f"v{n}"], [f"context{n}"], name=f"context{n}"),
            *(
                [
                    oh.make_node("Transpose", [h], [f"h_t{n}"], name=f"h_t{n}", perm=[0, 2, 1]),
                    oh.make_node("CumSum", [f"h_t{n}", "last_axis"], [f"sum_t{n}"], name=f"sum{n}"),
                    oh.make_node(
                        "Transpose",
                        [f"sum_t{n}"],
                        [f"running{n}"],
                        name=f"running{n}",
                        perm=[0, 2, 1],
                    ),
                ]
                if transposed
                else [oh.make_node("CumSum", [h, "seq_axis"], [f"running{n}"], name=f"running{n}")]
            ),
            oh.make_node(
                "Concat", [f"context{n}", f"running{n}"], [f"joined{n}"], name=f"join{n}", axis=2
            ),
            oh.make_node("MatMul", [f"joined{n}", f"wo{n}"], [f"h{n + 1}"], name=f"out{n}"),
        ]
        h = f"h{n + 1}"
    graph = oh.make_graph(
        nodes,
        "beside_a_running_sum",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 8])],
        [oh.make_tensor_value_info(h, TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=initializers,
    )
    return _opset17_model(graph)


@pytest.mark.parametrize(("layers", "transposed"), [(1, False), (2, False), (2, True)])
def test_an_output_joined_with_a_tensor_every_rank_holds_whole_is_gathered_before(
    layers: int, transposed: bool, tmp_path: Path
) -> None:
    # Each attention output is gathered before the Concat that joins it to the running sum,
    # which every rank computes whole: joined after it, a slice would meet the whole length.
    # With two blocks, the second block's input is read by the sum (directly, or through a
    # Transpose beside the walk): it must be whole, so the second block's Q, K and V are cut;
    # and its sum is whole because the first block's output was gathered, which only a second
    # walk forward, knowing that gather, can tell.
    model = _attention_beside_a_running_sum(layers, transposed=transposed)
    index, frontier = _frontier_of(model)
    assert [(t.name, t.seq_len_idx) for t in frontier.inputs] == [
        (f"{p}{n}", 1) for n in range(layers) for p in "qkv"
    ]
    assert [(t.name, t.seq_len_idx) for t in frontier.outputs] == [
        (f"context{n}", 1) for n in range(layers)
    ]
    assert frontier.warnings == []
    for ranks in (2, 4):
        assert _simulation_is_exact(model, index, tmp_path, ranks)


def _padding_mask_expanded_to_the_scores() -> onnx.ModelProto:
    """A key-padding mask made from the graph input ``keep`` ([batch, sequence]), reshaped to
    [batch, 1, keys] and expanded to the Shape of the scores, as TorchScript's XLM does."""
    weights, scores = _scores_of("x")
    constants = [
        oh.make_tensor("zero", TensorProto.INT64, [], [0]),
        oh.make_tensor("mask_shape", TensorProto.INT64, [3], [0, 1, -1]),
        oh.make_tensor("masked_out", TensorProto.FLOAT, [], [-1e4]),
    ]
    nodes = [
        *scores,
        oh.make_node("Equal", ["keep", "zero"], ["padded"], name="padded"),
        oh.make_node("Reshape", ["padded", "mask_shape"], ["padded_keys"], name="padded_keys"),
        oh.make_node("Shape", ["scores"], ["scores_shape"], name="scores_shape"),
        oh.make_node("Expand", ["padded_keys", "scores_shape"], ["mask"], name="mask"),
        oh.make_node("Where", ["mask", "masked_out", "scores"], ["masked"], name="masked"),
        oh.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"], name="context"),
    ]
    graph = oh.make_graph(
        nodes,
        "expanded_mask",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 8]),
            oh.make_tensor_value_info("keep", TensorProto.INT64, ["batch", SEQ]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=[*weights, *constants],
    )
    return _opset17_model(graph)


def test_a_mask_expanded_to_the_scores_shape_is_left_to_each_rank(tmp_path: Path) -> None:
    # The Shape of the scores gives each rank its own query length: the mask it expands to
    # is already the rank's rows. Scattering it (it was) would cut those rows again.
    model = _padding_mask_expanded_to_the_scores()
    index, frontier = _frontier_of(model)
    assert "mask" not in {t.name for t in frontier.inputs}
    for ranks in (2, 4):
        assert _simulation_is_exact(model, index, tmp_path, ranks)


def _mask_over_queries_and_keys(*, queries_from_keys: bool) -> onnx.ModelProto:
    """A mask over queries and keys made of the padding mask ``keep`` ([batch, sequence]):
    over the keys ([batch, 1, keys]) times over the queries ([batch, queries, 1]), added to
    the scores. ``queries_from_keys``: the second factor is the first turned over (DeBERTa's
    ``ext * ext.squeeze(-2).unsqueeze(-1)``), else both are made from ``kept``, keep as a
    float."""
    weights, scores = _scores_of("x")
    constants = [
        oh.make_tensor("axis_1", TensorProto.INT64, [1], [1]),
        oh.make_tensor("axis_2", TensorProto.INT64, [1], [2]),
    ]
    if queries_from_keys:
        factors = [
            oh.make_node("Unsqueeze", ["keep", "axis_1"], ["keys"], name="keys"),
            oh.make_node("Squeeze", ["keys", "axis_1"], ["turned"], name="turned"),
            oh.make_node("Unsqueeze", ["turned", "axis_2"], ["queries"], name="queries"),
        ]
    else:
        factors = [
            oh.make_node("Cast", ["keep"], ["kept"], name="kept", to=TensorProto.FLOAT),
            oh.make_node("Unsqueeze", ["kept", "axis_1"], ["keys"], name="keys"),
            oh.make_node("Unsqueeze", ["kept", "axis_2"], ["queries"], name="queries"),
        ]
    nodes = [
        *scores,
        *factors,
        oh.make_node("Mul", ["keys", "queries"], ["pair"], name="pair"),
        oh.make_node("Add", ["scores", "pair"], ["masked"], name="masked"),
        oh.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"], name="context"),
    ]
    graph = oh.make_graph(
        nodes,
        "mask_over_queries_and_keys",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 8]),
            oh.make_tensor_value_info("keep", TensorProto.FLOAT, ["batch", SEQ]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=[*weights, *constants],
    )
    return _opset17_model(graph)


@pytest.mark.parametrize(("queries_from_keys", "scattered"), [(True, "turned"), (False, "queries")])
def test_what_the_region_reads_broadcast_along_the_walk_is_whole_if_ranks_would_slice_it(
    queries_from_keys: bool, scattered: str, tmp_path: Path
) -> None:
    # The walk back from the mask's query axis reaches keep through the factor over the
    # queries. The Mul also reads `keys`, broadcast along the queries, which scattering keep
    # would cut along the keys (each rank's mask: [batch, its queries, its keys]): what
    # `keys` is computed from on the walk stays whole (`keys` itself, on DeBERTa's way, which
    # the real exports fixtures/real/*_pair_mask_encoder.onnx take; `kept` on the other).
    model = _mask_over_queries_and_keys(queries_from_keys=queries_from_keys)
    index, frontier = _frontier_of(model)
    assert [(t.name, t.seq_len_idx) for t in frontier.inputs] == [("x", 1), (scattered, 1)]
    for ranks in (2, 4):
        assert _simulation_is_exact(model, index, tmp_path, ranks)


def _static_heads(length: int = 8) -> onnx.ModelProto:
    """Attention over a fixed number of tokens whose head split and merge spell the number out
    (Reshapes to [-1, length, 2, 4] and back to [-1, length, 8]), as the dynamo exporter writes
    a static-shape ViT or CLIP."""
    weights = [
        oh.make_tensor(
            name, TensorProto.FLOAT, [8, 8], [0.05 * ((i * j) % 7 - 3) for i in range(64)]
        )
        for j, name in ((3, "wq"), (4, "wk"), (5, "wv"))
    ]
    constants = [
        oh.make_tensor("heads", TensorProto.INT64, [4], [-1, length, 2, 4]),
        oh.make_tensor("merged", TensorProto.INT64, [3], [-1, length, 8]),
    ]
    nodes = []
    for t in "qkv":
        nodes += [
            oh.make_node("MatMul", ["x", f"w{t}"], [f"{t}_proj"], name=f"{t}_proj"),
            oh.make_node("Reshape", [f"{t}_proj", "heads"], [f"{t}_split"], name=f"{t}_split"),
            oh.make_node("Transpose", [f"{t}_split"], [t], name=f"{t}_heads", perm=[0, 2, 1, 3]),
        ]
    nodes += [
        oh.make_node("Transpose", ["k"], ["k_t"], name="k_t", perm=[0, 1, 3, 2]),
        oh.make_node("MatMul", ["q", "k_t"], ["scores"], name="scores"),
        oh.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["context"], name="context"),
        oh.make_node("Transpose", ["context"], ["tokens"], name="tokens", perm=[0, 2, 1, 3]),
        oh.make_node("Reshape", ["tokens", "merged"], ["y"], name="merge"),
    ]
    graph = oh.make_graph(
        nodes,
        "static_heads",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", length, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", length, 8])],
        initializer=[*weights, *constants],
    )
    return _opset17_model(graph)


def test_a_reshape_that_spells_out_a_fixed_length_takes_no_slice(tmp_path: Path) -> None:
    # Each rank's slice of x, [batch, 4, 8], cannot be reshaped to [-1, 8, 2, 4]: the heads are
    # scattered after the split and gathered before the merge.
    model = _static_heads()
    index, frontier = _frontier_of(model)
    assert [(t.name, t.seq_len_idx) for t in frontier.inputs] == [
        ("q_split", 1),
        ("k_split", 1),
        ("v_split", 1),
    ]
    assert [(t.name, t.seq_len_idx) for t in frontier.outputs] == [("tokens", 1)]
    for ranks in (2, 4):
        assert _simulation_is_exact(model, index, tmp_path, ranks)


def _skip_layer_norm_between_layers() -> onnx.ModelProto:
    """Two attention layers joined as onnxruntime's transformer optimizer fuses GPT-2: the
    first layer's output and its input summed and normalised by one com.microsoft
    SkipLayerNormalization, whose normalised output feeds the second layer and whose sum
    (output 3) is the residual added to the second layer's output."""
    weights0, scores0 = _scores_of("x", 0)
    weights1, scores1 = _scores_of("normed", 1)
    norms = [
        oh.make_tensor("gamma", TensorProto.FLOAT, [8], [1.0 + 0.1 * i for i in range(8)]),
        oh.make_tensor("beta", TensorProto.FLOAT, [8], [0.01 * i for i in range(8)]),
    ]
    nodes = [
        *scores0,
        oh.make_node("Softmax", ["scores0"], ["probs0"], name="softmax0", axis=-1),
        oh.make_node("MatMul", ["probs0", "v0"], ["out0"], name="context0"),
        oh.make_node(
            "SkipLayerNormalization",
            ["out0", "x", "gamma", "beta"],
            ["normed", "", "", "residual"],
            name="skip_norm",
            domain="com.microsoft",
        ),
        *scores1,
        oh.make_node("Softmax", ["scores1"], ["probs1"], name="softmax1", axis=-1),
        oh.make_node("MatMul", ["probs1", "v1"], ["out1"], name="context1"),
        oh.make_node("Add", ["out1", "residual"], ["y"], name="residual_add"),
    ]
    graph = oh.make_graph(
        nodes,
        "skip_layer_norm",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=[*weights0, *weights1, *norms],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model


def test_a_skip_layer_normalisation_maps_its_skip_input_too(tmp_path: Path) -> None:
    # Its outputs are position-wise in both the first layer's output and the skip (x): x is
    # scattered once, the output gathered once, as without the fusion.
    model = _skip_layer_norm_between_layers()
    index, frontier = _frontier_of(model)
    assert [(t.name, t.seq_len_idx) for t in frontier.inputs] == [("x", 1)]
    assert [(t.name, t.seq_len_idx) for t in frontier.outputs] == [("y", 1)]
    assert not frontier.warnings
    for ranks in (2, 4):
        assert _simulation_is_exact(model, index, tmp_path, ranks)


def _next_token_paired() -> onnx.ModelProto:
    """Each position's features joined with the next position's (x[:, 1:] padded back to the
    sequence length with a zero row), then projected, as MobileBERT embeds token trigrams."""
    weights, scores = _scores_of("h")
    constants = [
        oh.make_tensor("one", TensorProto.INT64, [1], [1]),
        oh.make_tensor("to_the_end", TensorProto.INT64, [1], [2**62]),
        oh.make_tensor("pad_end", TensorProto.INT64, [6], [0, 0, 0, 0, 1, 0]),
        oh.make_tensor(
            "w_in", TensorProto.FLOAT, [8, 8], [0.03 * ((i * 5) % 11 - 5) for i in range(64)]
        ),
    ]
    nodes = [
        oh.make_node("Slice", ["x", "one", "to_the_end", "one"], ["next"], name="next"),
        oh.make_node("Pad", ["next", "pad_end"], ["next_padded"], name="next_padded"),
        oh.make_node("Concat", ["x", "next_padded"], ["pair"], name="pair", axis=2),
        oh.make_node("MatMul", ["pair", "w_in"], ["h"], name="embed"),
        *scores,
        oh.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"], name="context"),
    ]
    graph = oh.make_graph(
        nodes,
        "next_token_paired",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])],
        initializer=[*weights, *constants],
    )
    return _opset17_model(graph)


def test_features_of_the_next_position_are_joined_whole_then_scattered(tmp_path: Path) -> None:
    # The shift mixes positions (each rank's last row needs the next rank's first): the pair
    # is computed whole and scattered. It once lost its shape at the Pad, and with it the cut.
    model = _next_token_paired()
    index, frontier = _frontier_of(model)
    assert [(t.name, t.seq_len_idx, t.rank) for t in frontier.inputs] == [("pair", 1, 3)]
    for ranks in (2, 4):
        assert _simulation_is_exact(model, index, tmp_path, ranks)


def _sliced_by_following_every_cut_forward(index: GraphIndex, cut: set[str]) -> set[str]:
    """The definition, computed the direct way: everything reached from a cut through data."""
    sliced = set(cut)
    changed = True
    while changed:
        changed = False
        for node in index.nodes:
            if node.op_type in SHAPE_OPS or not any(name in sliced for name in node.inputs):
                continue
            for name in node.outputs:
                if name and name not in sliced:
                    sliced.add(name)
                    changed = True
    return sliced


def _analysed(name: str) -> tuple[GraphIndex, ShapeInference, list[AttentionLayer]]:
    index = load_index(REAL / name)
    shapes = ShapeInference(index)
    return index, shapes, detect_attention(index, shapes)


@pytest.mark.parametrize("name", REAL_NAMES)
def test_sliced_test_agrees_with_following_the_cuts_forward(name: str) -> None:
    index, _, layers = _analysed(name)
    # Cuts of two kinds: where the graph's data enters, and each layer's Q (inside the graph).
    for cut in (set(index.graph_inputs), {layer.q for layer in layers}):
        expected = _sliced_by_following_every_cut_forward(index, cut)
        ids = TensorIds(index)
        test = SlicedTest(ids, [ids.id[name] for name in cut])
        # Asked in reverse graph order, so that the memo is used deep in the graph first.
        # Every tensor a node reads or computes has an id; the others (weights no node
        # reads) are computed from nothing.
        for tensor in reversed(list(index.all_tensor_names())):
            if tensor in ids.id:
                assert test(ids.id[tensor]) == (tensor in expected), tensor
            else:
                assert tensor not in expected, tensor


@pytest.mark.parametrize("name", REAL_NAMES)
def test_tensor_ids_give_each_tensor_its_producers_inputs(name: str) -> None:
    index = load_index(REAL / name)
    ids = TensorIds(index)
    assert len(set(ids.id.values())) == len(ids.names) == len(ids.id)
    assert all(ids.names[ids.id[tensor]] == tensor for tensor in ids.names)
    for tensor in ids.names:
        producer = index.producer_of(tensor)
        parents, read = ids.parents[ids.id[tensor]], ids.shape_read[ids.id[tensor]]
        if producer is None:
            assert (parents, read) == (None, -1), tensor
        elif producer.op_type in SHAPE_OPS:
            assert (parents, ids.names[read]) == (None, producer.inputs[0]), tensor
        else:
            expected = tuple(ids.id[n] for n in producer.inputs if n)
            assert (parents, read) == (expected, -1), tensor


def test_tensor_ids_leave_out_omitted_inputs_and_follow_the_last_producer() -> None:
    nodes = [
        oh.make_node("Clip", ["x", "", "hi"], ["c"], name="clip"),
        oh.make_node("Shape", ["c"], ["s"], name="shape"),
        # Not a valid graph ("s" computed twice); the index takes the last producer.
        oh.make_node("Identity", ["c"], ["s"], name="again"),
        oh.make_node("Size", ["c"], ["n"], name="size"),
    ]
    graph = oh.make_graph(
        nodes,
        "ids",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "hi")],
        [oh.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("s", "n")],
    )
    ids = TensorIds(GraphIndex(oh.make_model(graph)))
    assert "" not in ids.id
    assert ids.parents[ids.id["c"]] == (ids.id["x"], ids.id["hi"])
    assert (ids.parents[ids.id["s"]], ids.shape_read[ids.id["s"]]) == ((ids.id["c"],), -1)
    assert (ids.parents[ids.id["n"]], ids.shape_read[ids.id["n"]]) == (None, ids.id["c"])
    assert ids.parents[ids.id["x"]] is None
    # Flags are set by name; a name without an id (an omitted output) reaches nothing.
    flags = ids.flags(["c", "", "nowhere"])
    assert [ids.names[i] for i, flag in enumerate(flags) if flag] == ["c"]


def test_a_length_reaching_a_cut_through_the_shape_of_an_unsliced_tensor_is_whole() -> None:
    # t is computed from the scattered x; z, from weights only, is reshaped to t's shape; the
    # cut k is made in z's shape. So t's length sizes k, through two Shapes: t is needed whole.
    nodes = [
        oh.make_node("Relu", ["x"], ["t"], name="relu"),
        oh.make_node("Shape", ["t"], ["s1"], name="shape_of_t"),
        oh.make_node("Reshape", ["w", "s1"], ["z"], name="reshape"),
        oh.make_node("Shape", ["z"], ["s2"], name="shape_of_z"),
        oh.make_node("ConstantOfShape", ["s2"], ["k"], name="fill"),
    ]
    graph = oh.make_graph(
        nodes,
        "through_shapes",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("x", "w")],
        [oh.make_tensor_value_info("k", TensorProto.FLOAT, None)],
    )
    index = GraphIndex(oh.make_model(graph))
    ids = TensorIds(index)
    cut = {"x": 0, "k": 0}
    # The Relu (node 0) is in the region: x is read inside it only.
    region = Region.of(ids, {**cut, "t": 0}, {0}, cut)
    assert must_be_whole(index, ids, region, set(), bytearray(len(ids.names))) == {"t"}


def _cut_fed_by_a_slice(*, through: str | None) -> tuple[GraphIndex, TensorIds, Region]:
    """x is scattered; the Relu computing t is in the region, so each rank holds a slice of
    t; the cut k is made by a Softmax (computed whole on every rank) from t, or from a Neg of
    t (``through``) that the region does not hold."""
    nodes = [oh.make_node("Relu", ["x"], ["t"], name="relu")]
    read = "t"
    if through is not None:
        nodes.append(oh.make_node("Neg", ["t"], [through], name="neg"))
        read = through
    nodes.append(oh.make_node("Softmax", [read], ["k"], name="softmax"))
    graph = oh.make_graph(
        nodes,
        "cut_fed_by_a_slice",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [oh.make_tensor_value_info("k", TensorProto.FLOAT, [4])],
    )
    index = GraphIndex(oh.make_model(graph))
    ids = TensorIds(index)
    cut = {"x": 0, "k": 0}
    return index, ids, Region.of(ids, {**cut, "t": 0}, {0}, cut)


@pytest.mark.parametrize("through", [None, "u"])
def test_a_region_tensor_a_cut_is_computed_from_is_whole(through: str | None) -> None:
    # Directly, or through u, which is computed from the slice of t and so is a slice too:
    # the Softmax would read a slice where it needs the whole of t.
    index, ids, region = _cut_fed_by_a_slice(through=through)
    assert must_be_whole(index, ids, region, set(), bytearray(len(ids.names))) == {"t"}


def test_a_cut_another_cut_is_computed_from_after_the_layers_is_whole() -> None:
    # The same graph, the Relu now after the layers (one of forward_nodes, so x is read by no
    # node outside the region) and t off the region: the cut k is computed whole from the
    # slice of x, through t.
    index, ids, _ = _cut_fed_by_a_slice(through=None)
    cut = {"x": 0, "k": 0}
    region = Region.of(ids, dict(cut), set(), cut)
    assert must_be_whole(index, ids, region, {0}, bytearray(len(ids.names))) == {"x"}


@pytest.mark.parametrize("through", [None, "u"])
def test_a_layer_output_a_cut_is_computed_from_is_left_to_the_gathers(
    through: str | None,
) -> None:
    # An attention layer's output reaches what follows it through the gathered tensors.
    index, ids, region = _cut_fed_by_a_slice(through=through)
    layer_outputs = ids.flags(["t"])
    assert must_be_whole(index, ids, region, set(), layer_outputs) == set()


def test_sliced_test_ends_on_a_cycle() -> None:
    nodes = [
        oh.make_node("Add", ["x", "b"], ["a"], name="first"),
        oh.make_node("Relu", ["a"], ["b"], name="second"),
    ]
    graph = oh.make_graph(
        nodes,
        "cycle",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [oh.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
    )
    ids = TensorIds(GraphIndex(oh.make_model(graph)))
    assert SlicedTest(ids, [ids.id["x"]])(ids.id["b"]) is True
    assert SlicedTest(ids, [])(ids.id["b"]) is False


@pytest.mark.parametrize("name", REAL_NAMES)
def test_sizable_nodes_are_those_with_an_input_computed_from_a_shape(name: str) -> None:
    index = load_index(REAL / name)
    derived = data_derived(index)
    sources = ShapeSources(index, TensorIds(index), derived)
    # The definition, through the memoised source sets of each input.
    expected = {
        node.index
        for node in index.nodes
        if node.op_type not in SHAPE_OPS
        and any(
            input_name and input_name not in derived and sources.of(input_name)
            for input_name in node.inputs
        )
    }
    assert sources.sizable == expected


def _first_output_axis_by_trying_each(
    mapper: AxisMapper, node: Node, tensor: str, axis: int
) -> int | None:
    """output_axis by its definition: the first output axis whose input axes hold the input's."""
    rank = mapper.shapes.rank(node.outputs[0]) if node.outputs else None
    for out_axis in range(rank or 0):
        mapped = mapper.input_axes(node, out_axis)
        if mapped and (tensor, axis) in mapped:
            return out_axis
    return None


@pytest.mark.parametrize("name", REAL_NAMES)
def test_output_axis_is_the_first_output_axis_that_maps_back_to_the_input(name: str) -> None:
    index, shapes, layers = _analysed(name)
    q_shape = shapes.shape(layers[0].q) if layers else None
    seq = q_shape[layers[0].q_axis] if q_shape and layers[0].q_axis is not None else None
    mapper = AxisMapper(index, shapes, seq)
    tried = 0
    for node in index.nodes:
        for tensor in dict.fromkeys(t for t in node.inputs if t):
            for axis in range(shapes.rank(tensor) or 0):
                expected = _first_output_axis_by_trying_each(mapper, node, tensor, axis)
                assert mapper.output_axis(node, tensor, axis) == expected, (node.label, axis)
                tried += expected is not None
    assert tried > 0


def _numeric(dims: list[Dim], primes: dict[str, int]) -> int:
    """A size with every symbol replaced by its own prime: equal products, equal numbers."""
    total = 1
    for dim in dims:
        for factor in str(dim).split("*"):
            if not factor.isdigit():
                factor = str(primes.setdefault(factor, _PRIMES[len(primes)]))
            total *= int(factor)
    return total


_PRIMES = [1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061, 1063, 1069, 1087, 1091]


@pytest.mark.parametrize("name", REAL_NAMES)
def test_reshape_blocks_pair_runs_of_axes_of_equal_size(name: str) -> None:
    index = load_index(REAL / name)
    if index.model.functions:  # the Reshapes are in the function bodies: inlined
        index = GraphIndex(onnx.inliner.inline_local_functions(index.model))
    shapes = ShapeInference(index)
    checked = 0
    for node in index.nodes:
        if node.op_type != "Reshape":
            continue
        source, target = shapes.shape(node.inputs[0]), shapes.shape(node.outputs[0])
        if source is None or target is None or None in source or None in target:
            continue
        blocks = _blocks(source, target)
        primes: dict[str, int] = {}
        # Consecutive runs of axes from the first on, of equal sizes on both sides.
        expected_in = expected_out = 0
        for in_axes, out_axes in blocks:
            assert in_axes == list(range(expected_in, expected_in + len(in_axes)))
            assert out_axes == list(range(expected_out, expected_out + len(out_axes)))
            expected_in += len(in_axes)
            expected_out += len(out_axes)
            sizes_in = [source[a] for a in in_axes]
            sizes_out = [target[a] for a in out_axes]
            assert _numeric(sizes_in, primes) == _numeric(sizes_out, primes), node.label
            checked += 1
    assert checked > 0
