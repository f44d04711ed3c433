"""Symbolic dims through Reshape's -1 and through integer division."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURE_MODELS, FIXTURES, embedded_bert_layer
from onnx import helper as oh
from onnx import numpy_helper

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import (
    _divide,
    broadcast,
    reshape_dims,
    shifted,
    size_of,
    window_count,
)
from shardcheck.graph.index import GraphIndex, Shape
from shardcheck.graph.loader import load_index
from shardcheck.graph.ops import REDUCTIONS


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        (("b", "s", 768), (0, 0, 12, -1), ("b", "s", 12, 64)),
        (("b", "s", 12, 64), (0, 0, -1), ("b", "s", 768)),
        (("b", "s", 768), (-1, 768), ("b*s", 768)),
        (("b", "s", 768), ("s", -1, 768), ("s", "b", 768)),
        # Merged dims count their factors: 2 * 8 = 16 is what is left with b.
        (("b", "s*2", 8), ("s", -1), ("s", "16*b")),
        # 7 does not divide 768 * b * s, symbols and all: unknown.
        (("b", "s", 768), (7, -1), (7, None)),
        # x is not a factor of the whole: unknown.
        (("b", "s", 768), (0, "x", -1), ("b", "x", None)),
        (("b", None, 768), (0, -1), ("b", None)),
    ],
)
def test_reshape_infers_the_minus_one_from_symbols_and_integers(
    source: Shape, target: Shape, expected: Shape
) -> None:
    assert reshape_dims(source, target) == expected


def test_sizes_of_equal_products_are_equal() -> None:
    assert size_of(["b", "s", 12]) == size_of(["s*b", 3, 4]) == (12, ("b", "s"))
    assert size_of(["b", "b", 2]) != size_of(["b", 2])
    assert size_of(["b", None]) is None


def test_division_removes_an_integer_factor_only_when_it_divides() -> None:
    assert _divide("2*batch", 2) == "batch"
    assert _divide("4*a*b", 2) == "2*a*b"
    assert _divide("batch", 2) is None


# --------------------------------------------------------------------------- memoized rules


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda m: m.name)
def test_memoized_rules_give_what_each_rule_run_gives(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = load_index(model)
    memoized = ShapeInference(index).info
    monkeypatch.setattr(ShapeInference, "_memo_key", lambda self, node: None)
    every_rule_run = ShapeInference(index).info
    # repr: 1 and True, or 1 and 1.0, are equal but not the same dim.
    assert repr(sorted(memoized.items())) == repr(sorted(every_rule_run.items()))


def _unsqueezed(axes: list[onnx.NodeProto | onnx.TensorProto], axes_names: list[str]) -> dict:
    """x [2, 3] unsqueezed once per axes tensor; the inferred output shapes."""
    nodes = [node for node in axes if isinstance(node, onnx.NodeProto)]
    initializers = [tensor for tensor in axes if isinstance(tensor, onnx.TensorProto)]
    for position, name in enumerate(axes_names):
        nodes.append(oh.make_node("Unsqueeze", ["x", name], [f"y{position}"]))
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None) for i in range(2)],
        initializers,
    )
    shapes = ShapeInference(GraphIndex(oh.make_model(graph)))
    return {f"y{i}": shapes.shape(f"y{i}") for i in range(len(axes_names))}


def _int64(name: str, values: list[list[int]]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def test_constants_of_one_shape_and_different_values_are_not_taken_for_each_other() -> None:
    # [1, 1]-shaped axes: their info holds no value (only 1-D ones do), so only their data
    # tells them apart; both as initializers and as Constant nodes.
    expected = {"y0": (2, 1, 3), "y1": (1, 2, 3)}
    initializers = [_int64("a", [[1]]), _int64("b", [[0]])]
    assert _unsqueezed(initializers, ["a", "b"]) == expected
    constants = [
        oh.make_node("Constant", [], [tensor.name], value=tensor) for tensor in initializers
    ]
    assert _unsqueezed(constants, ["a", "b"]) == expected


def test_a_computed_tensor_is_not_taken_for_a_constant_of_the_same_value() -> None:
    # "c" holds [1] as a constant; "s" holds [1] too, computed (the length of a 1-D shape):
    # a rule reads axes only from constants, so the second Unsqueeze has no known shape.
    shape_of_c = oh.make_node("Shape", ["c"], ["s"])
    shapes = _unsqueezed(
        [numpy_helper.from_array(np.array([1], np.int64), "c"), shape_of_c], ["c", "s"]
    )
    assert shapes == {"y0": (2, 1, 3), "y1": None}


# --------------------------------------------------------------------------- symbolic lengths


def _strided_front_end() -> onnx.ModelProto:
    """An audio encoder's front end over ``samples``: two strided convolutions, then a
    padded one whose even kernel gives one window too many, trimmed by a Slice (x[..., :-1]),
    then a Slice dropping the first two frames (x[..., 2:])."""
    rng = np.random.default_rng(7)
    weights = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (("w1", (4, 1, 10)), ("w2", (4, 4, 3)), ("w3", (4, 4, 16)))
    ]
    ints = [
        numpy_helper.from_array(np.array(values, dtype=np.int64), name)
        for name, values in (
            ("zero", [0]),
            ("minus_one", [-1]),
            ("two", [2]),
            ("end", [2**62]),
            ("last", [2]),
        )
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["c1"], strides=[5]),
        oh.make_node("Conv", ["c1", "w2"], ["c2"], strides=[2]),
        oh.make_node("Conv", ["c2", "w3"], ["c3"], pads=[8, 8]),
        oh.make_node("Slice", ["c3", "zero", "minus_one", "last"], ["trimmed"]),
        oh.make_node("Slice", ["trimmed", "two", "end", "last"], ["late"]),
    ]
    graph = oh.make_graph(
        nodes,
        "front_end",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 1, "samples"])],
        [oh.make_tensor_value_info("late", onnx.TensorProto.FLOAT, None)],
        initializer=[*weights, *ints],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_strided_convolutions_and_trims_keep_the_length_symbolic() -> None:
    import onnxruntime

    model = _strided_front_end()
    shapes = ShapeInference(GraphIndex(model))
    names = ["c1", "c2", "c3", "trimmed", "late"]
    lengths = {name: shapes.shape(name)[2] for name in names}  # type: ignore[index]
    assert lengths == {
        "c1": "(samples - 10)//5 + 1",
        "c2": "((samples - 10)//5 - 2)//2 + 1",
        # The padding less the span is +1 at stride 1: one window more; the trim folds it back.
        "c3": "((samples - 10)//5 - 2)//2 + 2",
        "trimmed": "((samples - 10)//5 - 2)//2 + 1",
        "late": "((samples - 10)//5 - 2)//2 - 1",
    }
    # onnxruntime agrees at several lengths (every tensor exposed as an output).
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.output[:]
    exposed.graph.output.extend(oh.make_empty_tensor_value_info(name) for name in names)
    session = onnxruntime.InferenceSession(
        exposed.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(0)
    for samples in (100, 333, 650):
        feeds = {"x": rng.standard_normal((1, 1, samples)).astype(np.float32)}
        for name, value in zip(names, session.run(names, feeds), strict=True):
            # The expressions hold only names, integers, +, - and //.
            expected = eval(lengths[name], {"__builtins__": {}}, {"samples": samples})
            assert value.shape[2] == expected, (name, samples)


@pytest.mark.parametrize(
    ("shapes", "expected"),
    [
        # An unknown dim beside a known one other than 1 is 1 or that dim: the result is it.
        ([("b", "s", 32), ("b", None, 1)], ("b", "s", 32)),
        ([("b", None, 32), (1, 7, 1)], ("b", 7, 32)),
        # Beside 1 (or alone) it stays unknown.
        ([(None, 4), (1, 4)], (None, 4)),
        ([(1, 1), (1, 1)], (1, 1)),
    ],
)
def test_broadcasting_an_unknown_dim(shapes: list[Shape], expected: Shape) -> None:
    assert broadcast(shapes) == expected


def _last_tokens(start_known: bool) -> onnx.ModelProto:
    """ids[:, -n:] with n the length of ids itself (XLM keeps the last tokens), read through
    Shape, Gather and Neg; or (``start_known`` False) from a start given as an input."""
    ints = [
        numpy_helper.from_array(np.array(value, dtype=np.int64), name)
        for name, value in (("one", 1), ("axes", [1]), ("end", [2**62]), ("unsqueeze_axes", [0]))
    ]
    nodes = [
        oh.make_node("Shape", ["ids"], ["ids_shape"]),
        oh.make_node("Gather", ["ids_shape", "one"], ["length"], axis=0),
        oh.make_node("Neg", ["length"], ["minus_length"]),
        oh.make_node("Unsqueeze", ["minus_length", "unsqueeze_axes"], ["start"]),
        oh.make_node(
            "Slice", ["ids", "start" if start_known else "given", "end", "axes"], ["last"]
        ),
    ]
    inputs = [oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", "sequence"])]
    if not start_known:
        inputs.append(oh.make_tensor_value_info("given", onnx.TensorProto.INT64, [1]))
    graph = oh.make_graph(
        nodes,
        "last_tokens",
        inputs,
        [oh.make_tensor_value_info("last", onnx.TensorProto.INT64, None)],
        initializer=ints,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_the_last_n_of_a_length_n_is_all_of_it() -> None:
    shapes = ShapeInference(GraphIndex(_last_tokens(start_known=True)))
    assert shapes.value("minus_length") == ("-sequence",)
    assert shapes.shape("last") == ("batch", "sequence")


def test_a_slice_from_an_unknown_start_keeps_the_rank_and_the_other_axes() -> None:
    shapes = ShapeInference(GraphIndex(_last_tokens(start_known=False)))
    assert shapes.shape("last") == ("batch", None)


@pytest.mark.parametrize(
    ("pads", "axes", "expected"),
    [
        ([0, 0, 0, 0, 1, 0], None, ("batch", "sequence", 4)),  # x[:, 1:] padded back
        ([0, 2, 1, 0, 3, 0], None, ("batch", "sequence + 4", 5)),
        ([1, 1], [2], ("batch", "sequence - 1", 6)),  # opset 18: pads of the axes given
    ],
)
def test_pad_grows_each_axis_by_its_pads(
    pads: list[int], axes: list[int] | None, expected: Shape
) -> None:
    ints = [
        numpy_helper.from_array(np.array(values, dtype=np.int64), name)
        for name, values in (("one", [1]), ("to_the_end", [2**62]), ("pads", pads))
    ]
    pad_inputs = ["next", "pads"]
    if axes is not None:
        ints.append(numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes"))
        pad_inputs += ["", "axes"]
    nodes = [
        oh.make_node("Slice", ["x", "one", "to_the_end", "one"], ["next"]),
        oh.make_node("Pad", pad_inputs, ["padded"]),
    ]
    graph = oh.make_graph(
        nodes,
        "pad",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "sequence", 4])],
        [oh.make_tensor_value_info("padded", onnx.TensorProto.FLOAT, None)],
        initializer=ints,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    shapes = ShapeInference(GraphIndex(model))
    assert shapes.shape("next") == ("batch", "sequence - 1", 4)
    assert shapes.shape("padded") == expected


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@pytest.mark.parametrize("keepdims", [0, 1])
def test_every_reduction_keeps_the_axes_it_does_not_reduce(op: str, keepdims: int) -> None:
    # One table of reductions serves shapes and axes: none is known to one and not the other.
    graph = oh.make_graph(
        [oh.make_node(op, ["x", "axes"], ["reduced"], keepdims=keepdims)],
        "reduce",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "sequence", 8])],
        [oh.make_tensor_value_info("reduced", onnx.TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([2], dtype=np.int64), "axes")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    index = GraphIndex(model)
    shapes = ShapeInference(index)
    assert shapes.shape("reduced") == ("batch", "sequence", 1)[: 3 if keepdims else 2]
    mapper = AxisMapper(index, shapes, "sequence")
    assert mapper.input_axes(index.nodes[0], 1) == [("x", 1)]
    assert mapper.input_axes(index.nodes[0], 2) is None


def test_lengths_too_long_to_read_become_unknown() -> None:
    # A hostile dim_param: 200k characters of trailing terms would be folded one recursion per
    # term. Past 256 characters a dim is not read as an expression: unknown, no error.
    hostile = "s" + " + 1" * 50_000
    assert shifted(hostile, -1) is None
    assert window_count(hostile, -3, 2) is None
    assert shifted("s" * 300, 1) is None
    assert shifted("s" * 254, 10) is None  # 259 characters: the result would pass the limit
    assert shifted("s + 3", -3) == "s"
    assert window_count("s", -3, 2) == "(s - 3)//2 + 1"


@pytest.mark.parametrize(
    ("op", "fmod", "a", "b", "expected"),
    [
        ("Mod", 0, 2, 3, 2),
        ("Mod", 1, 7, 3, 1),
        ("Mod", 0, -7, 3, None),  # the two Mods differ on signs: not guessed
        ("Max", 0, 2, 3, 3),
        ("Min", 0, 2, 3, 2),
    ],
)
def test_small_integer_values_through_mod_max_and_min(
    op: str, fmod: int, a: int, b: int, expected: int | None
) -> None:
    attributes = {"fmod": fmod} if op == "Mod" else {}
    graph = oh.make_graph(
        [oh.make_node(op, ["a", "b"], ["out"], **attributes)],
        "values",
        [],
        [oh.make_tensor_value_info("out", onnx.TensorProto.INT64, None)],
        initializer=[
            numpy_helper.from_array(np.array([a], dtype=np.int64), "a"),
            numpy_helper.from_array(np.array([b], dtype=np.int64), "b"),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    assert ShapeInference(GraphIndex(model)).value("out") == (expected,)


def test_multihead_attention_keeps_its_shapes_through_the_in_projection_split() -> None:
    # TorchScript's nn.MultiheadAttention unflattens [S, B, 3E] at a split point it computes
    # with a Mod; the K and V Reshapes that follow hold the traced length (TRUTH.json).
    shapes = ShapeInference(load_index(FIXTURES / "real" / "ts_mha_seq_first.onnx"))
    assert shapes.shape("/attn/Reshape_2_output_0") == ("sequence", "batch", 3, 24)
    assert shapes.shape("/attn/Reshape_4_output_0") == (8, "2*batch", 12)


def test_embed_layer_normalisation_gives_the_ids_embedded_and_the_mask_index() -> None:
    import onnxruntime

    model = embedded_bert_layer()
    shapes = ShapeInference(GraphIndex(model))
    assert shapes.shape("embedded") == ("batch", "sequence", 8)
    assert shapes.shape("mask_index") == ("batch",)
    # What onnxruntime computes, at batch 2 and length 5.
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(
        oh.make_tensor_value_info(name, elem, None)
        for name, elem in (
            ("embedded", onnx.TensorProto.FLOAT),
            ("mask_index", onnx.TensorProto.INT32),
        )
    )
    session = onnxruntime.InferenceSession(probe.SerializeToString())
    feeds = {
        "ids": np.arange(10, dtype=np.int32).reshape(2, 5) % 16,
        "mask": np.ones((2, 5), dtype=np.int32),
    }
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, feeds), strict=True))
    assert outputs["embedded"].shape == (2, 5, 8) and outputs["mask_index"].shape == (2,)


@pytest.mark.parametrize(
    "start, delta, expected",
    [(0.0, 1.0, ("seq",)), (2.0, 1.0, (None,)), (0.5, 1.0, (None,)), (0.0, 2.0, (None,))],
)
@pytest.mark.parametrize("stored", ["raw_data", "float_data", "value_float"])
def test_a_float_range_over_a_length_has_that_length(
    start: float, delta: float, expected: Shape, stored: str
) -> None:
    # arange(x.shape[1], dtype=float): Range(0.0, Cast(Shape(x)[1]), 1.0) has x's length; one
    # from 2.0 would have seq - 2, which dims do not say (unknown, not wrong).
    nodes = [
        oh.make_node("Shape", ["x"], ["shape"], start=1, end=2),
        oh.make_node("Squeeze", ["shape"], ["length"]),
        oh.make_node("Cast", ["length"], ["limit"], to=onnx.TensorProto.FLOAT),
        oh.make_node("Range", ["start", "limit", "delta"], ["positions"]),
    ]
    constants = {"start": start, "delta": delta}
    initializers = []
    for name, number in constants.items():
        if stored == "value_float":
            nodes.insert(0, oh.make_node("Constant", [], [name], value_float=number))
        elif stored == "float_data":
            initializers.append(oh.make_tensor(name, onnx.TensorProto.FLOAT, [], [number]))
        else:
            initializers.append(numpy_helper.from_array(np.array(number, np.float32), name))
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "seq"])],
        [oh.make_tensor_value_info("positions", onnx.TensorProto.FLOAT, None)],
        initializers,
    )
    index = GraphIndex(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))
    assert ShapeInference(index).shape("positions") == expected


def test_torchscript_f_pad_pads_are_folded_through_their_matrix() -> None:
    # MobileBERT's trigram embedding: cat([pad(e[:, 1:], (0, 0, 0, 1)), e,
    # pad(e[:, :-1], (0, 0, 1, 0))], dim=2). TorchScript turns each F.pad's pads (last dim
    # first, [begin, end] per dim) into ONNX's [begins..., ends...] by a [-1, 2] Reshape of
    # the 6 pads, a Slice of its rows with step -1 and a Transpose: (0, 0, 0, 1) pads the
    # sequence axis 1 by one at its end, (0, 0, 1, 0) by one at its start.
    index = load_index(FIXTURES / "real" / "ts_mobilebert_tiny.onnx")
    shapes = ShapeInference(index)
    pads = {}
    for node in index.nodes:
        if node.op_type == "Pad":
            pads[node.inputs[0]] = shapes.value(node.inputs[1])
            # Each shifted copy [batch, sequence - 1, 16] padded back to the whole length.
            assert shapes.shape(node.outputs[0]) == ("batch", "sequence", 16)
    assert sorted(pads.values()) == [(0, 0, 0, 0, 1, 0), (0, 1, 0, 0, 0, 0)]


def test_a_matrix_value_is_reshaped_sliced_and_transposed() -> None:
    # [1, 2, 3, 4, 5, 6] as [[1, 2], [3, 4], [5, 6]]; rows reversed: [[5, 6], [3, 4], [1, 2]];
    # transposed: [[5, 3, 1], [6, 4, 2]]; flattened; and added to (a vector's value would be
    # broadcast wrongly by the matrix's flat elements, so an Add of the matrix has none).
    ints = {
        "values": [1, 2, 3, 4, 5, 6],
        "rows": [-1, 2],
        "start": [-1],
        "end": [-(2**63) + 1],
        "axis": [0],
        "step": [-1],
        "flat": [-1],
    }
    constants = [
        oh.make_node("Constant", [], [name], value=oh.make_tensor(name, onnx.TensorProto.INT64,
                                                                  [len(v)], v))
        for name, v in ints.items()
    ]  # fmt: skip
    nodes = [
        *constants,
        oh.make_node("Reshape", ["values", "rows"], ["matrix"]),
        oh.make_node("Slice", ["matrix", "start", "end", "axis", "step"], ["reversed"]),
        oh.make_node("Transpose", ["reversed"], ["turned"], perm=[1, 0]),
        oh.make_node("Reshape", ["turned", "flat"], ["pads"]),
        oh.make_node("Add", ["turned", "turned"], ["doubled"]),
    ]
    graph = oh.make_graph(
        nodes, "pads", [], [oh.make_tensor_value_info(n, onnx.TensorProto.INT64, None)
                            for n in ("pads", "doubled")]
    )  # fmt: skip
    shapes = ShapeInference(GraphIndex(oh.make_model(graph)))
    assert shapes.value("matrix") == (1, 2, 3, 4, 5, 6)
    assert shapes.shape("reversed") == (3, 2)
    assert shapes.value("reversed") == (5, 6, 3, 4, 1, 2)
    assert shapes.value("turned") == (5, 3, 1, 6, 4, 2)
    assert shapes.shape("pads") == (6,)
    assert shapes.value("pads") == (5, 3, 1, 6, 4, 2)
    assert shapes.shape("doubled") == (2, 3)
    assert shapes.value("doubled") is None


def test_an_eye_like_has_its_input_shape() -> None:
    # XLNet builds its [S, S] mask's diagonal so: before this rule, explain could not count
    # its plan past the EyeLike.
    graph = oh.make_graph(
        [oh.make_node("EyeLike", ["square"], ["eye"])],
        "eye",
        [oh.make_tensor_value_info("square", onnx.TensorProto.FLOAT, ["sequence", "sequence"])],
        [oh.make_tensor_value_info("eye", onnx.TensorProto.FLOAT, None)],
    )
    shapes = ShapeInference(GraphIndex(oh.make_model(graph)))
    assert shapes.shape("eye") == ("sequence", "sequence")
