"""Einsum equations (shardcheck/einsum.py), and attention written with them whatever the
operands' order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from shardcheck import GenOptions, detect_attention, generate, load_index, simulate
from shardcheck.analysis.einsum import context_roles, parse, score_roles
from shardcheck.analysis.shapes import ShapeInference


@pytest.mark.parametrize(
    ("equation", "ranks", "inputs", "output"),
    [
        ("bhid,bhjd->bhij", [4, 4], ["bhid", "bhjd"], "bhij"),
        ("b h i d, b h j d -> b h i j", [None, None], ["bhid", "bhjd"], "bhij"),
        ("ij,jk", [2, 2], ["ij", "jk"], "ik"),  # implicit: the letters seen once, sorted
        ("ba,ca", [2, 2], ["ba", "ca"], "bc"),
    ],
)
def test_equations_label_each_axis(
    equation: str, ranks: list[int | None], inputs: list[str], output: str
) -> None:
    parsed = parse(equation, ranks)
    assert parsed is not None
    assert parsed.inputs == tuple(tuple(term) for term in inputs)
    assert parsed.output == tuple(output)


def test_an_ellipsis_stands_for_the_axes_aligned_from_the_right() -> None:
    parsed = parse("...id,...jd->...ij", [4, 3])
    assert parsed is not None
    assert parsed.inputs == (("...1", "...0", "i", "d"), ("...0", "j", "d"))
    assert parsed.output == ("...1", "...0", "i", "j")
    assert parsed.sources(1) == [(0, 1), (1, 0)]
    assert parse("...id->...i", [None]) is None  # how many axes it stands for is unknown


@pytest.mark.parametrize(
    ("equation", "ranks"),
    [
        ("bhid,bhjd->bhij", [3, 4]),  # a rank that the term does not have
        ("ij,jk->iz", [2, 2]),  # an output letter no input has
        ("ij,jk->ii", [2, 2]),  # an output letter twice
        ("ij,jk", [2]),  # two terms, one input
        ("i1,jk->ik", [2, 2]),  # not a letter
        ("..i...,j->ij", [3, 1]),  # two ellipses in a term
    ],
)
def test_equations_that_cannot_be_read_are_none(equation: str, ranks: list[int | None]) -> None:
    assert parse(equation, ranks) is None


def test_a_diagonal_has_no_single_source() -> None:
    parsed = parse("ii->i", [2])
    assert parsed is not None and parsed.sources(0) is None


@pytest.mark.parametrize(
    ("equation", "key_axis", "expected"),
    [
        ("bhid,bhjd->bhij", -1, (0, 1, 2, 2)),
        ("bhjd,bhid->bhij", -1, (1, 0, 2, 2)),  # K first
        ("bihd,bjhd->bhij", 3, (0, 1, 1, 1)),  # heads after the positions
        ("bhid,bhdj->bhij", -1, (0, 1, 2, 3)),  # K already transposed
    ],
)
def test_the_key_axis_of_the_scores_tells_q_from_k(
    equation: str, key_axis: int, expected: tuple[int, int, int, int]
) -> None:
    parsed = parse(equation, [4, 4])
    assert parsed is not None
    roles = score_roles(parsed, key_axis)
    assert roles is not None
    assert (roles.q, roles.k, roles.q_axis, roles.k_axis) == expected


@pytest.mark.parametrize(
    "equation",
    [
        "bhid,bhjd->bhijd",  # nothing contracted: not scores
        "bhid,bhid->bhi",  # the key label on both sides
        "...id,...jd->...ij",  # an ellipsis: not read as attention
    ],
)
def test_einsums_that_are_not_scores_have_no_roles(equation: str) -> None:
    parsed = parse(equation, [4, 4])
    assert parsed is None or score_roles(parsed, -1) is None


@pytest.mark.parametrize(
    ("equation", "probs", "expected"),
    [
        ("bhij,bhjd->bhid", 0, (1, 2, 2)),
        ("bhjd,bhij->bhid", 1, (0, 2, 2)),  # V first
        ("bhij,bjhd->bihd", 0, (1, 1, 1)),  # the output with heads after the positions
    ],
)
def test_the_probabilities_tell_v_and_the_query_axis_of_the_output(
    equation: str, probs: int, expected: tuple[int, int, int]
) -> None:
    parsed = parse(equation, [4, 4])
    assert parsed is not None
    roles = context_roles(parsed, probs)
    assert roles is not None
    assert (roles.v, roles.v_axis, roles.output_axis) == expected


def _swapped_einsum_attention(path: Path) -> Path:
    """One attention layer on x [batch, seq, 8] with 2 heads, whose einsums take K before Q
    and V before the probabilities, and put the heads after the positions."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"W_{p}")
        for p in "qkvo"
    ]
    heads = numpy_helper.from_array(np.array([0, 0, 2, 4], dtype=np.int64), "heads")
    merged = numpy_helper.from_array(np.array([0, 0, 8], dtype=np.int64), "merged")
    nodes = [
        *(helper.make_node("MatMul", ["x", f"W_{p}"], [f"{p}_flat"]) for p in "qkv"),
        *(helper.make_node("Reshape", [f"{p}_flat", "heads"], [p]) for p in "qkv"),
        helper.make_node("Einsum", ["k", "q"], ["scores"], equation="bjhd,bihd->bhij"),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("Einsum", ["v", "probs"], ["context"], equation="bjhd,bhij->bihd"),
        helper.make_node("Reshape", ["context", "merged"], ["context_flat"]),
        helper.make_node("MatMul", ["context_flat", "W_o"], ["y"]),
    ]
    for position, node in enumerate(nodes):
        node.name = f"n{position}_{node.op_type}"
    graph = helper.make_graph(
        nodes,
        "swapped_einsum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
        [*weights, heads, merged],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def test_attention_with_swapped_einsum_operands_is_found_and_sharded(tmp_path: Path) -> None:
    path = _swapped_einsum_attention(tmp_path / "swapped.onnx")
    index = load_index(path)
    shapes = ShapeInference(index)
    assert shapes.shape("scores") == ("batch", 2, "seq", "seq")
    assert shapes.shape("context") == ("batch", "seq", 2, 4)
    (layer,) = detect_attention(index, shapes)
    assert (layer.q, layer.gathered_k, layer.gathered_v) == ("q", "k", "v")
    assert (layer.q_axis, layer.k_axis, layer.v_axis, layer.output_axis) == (1, 1, 1, 1)
    hints = generate(index, GenOptions()).hints
    assert (hints.k_seq_len_idx, hints.v_seq_len_idx) == (1, 1)
    assert [(t.name, t.seq_len_idx) for t in hints.inputs] == [("x", 1)]
    assert [(t.name, t.seq_len_idx) for t in hints.outputs] == [("y", 1)]
    for ranks in (2, 4):
        result = simulate(path, hints, ranks=ranks, seq_len=8)
        assert result.ok, result.summary()
    # The K index of a q @ k^T layout would gather the head dim: the simulation differs.
    assert not simulate(path, hints.with_changes(k_seq_len_idx=3), ranks=2, seq_len=8).ok
