"""Biases and masks a model builds from the length of a tensor inside it (issue 28, class 1):
ALiBi written by hand and sliding windows, ``Range(Shape(x)[1])`` per layer or once.

Each rank would build them over its own slice's length while the keys are whole; the exact
cut scatters each layer's Q, K and V and the bias along its query axis, computed whole. The
simulation of gen's hints at 2 and 4 ranks, batch 1 and 2, is in
tests/generation/test_gen_real.py (these fixtures are in its shardable set).
"""

from __future__ import annotations

import pytest
from conftest import FIXTURES, run_cli

from shardcheck import GenOptions, generate, load_index
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference

REAL = FIXTURES / "real"
LENGTH_BIASED = [
    "ts_alibi_per_layer",
    "dynamo_alibi_per_layer",
    "ts_alibi_once",
    "ts_window_per_layer",
    "dynamo_window_per_layer",
]


@pytest.mark.parametrize("name", LENGTH_BIASED)
def test_each_layers_bias_is_scattered_along_its_query_axis(name: str) -> None:
    index = load_index(REAL / f"{name}.onnx")
    shapes = ShapeInference(index)
    hints = generate(index, GenOptions()).hints
    scattered = {t.name: t.seq_len_idx for t in hints.inputs}
    # input_ids stays whole: every rank builds the bias from the whole length.
    assert not set(scattered) & set(index.graph_inputs)
    for layer in detect_attention(index, shapes):
        # ALiBi is [heads, S, S], the window [S, S] (LengthBiasedEncoder._bias): the query axis
        # is the second to last.
        (bias,) = layer.masks
        assert scattered[bias] == len(shapes.shape(bias)) - 2, bias
        if name == "ts_alibi_once":
            continue  # its second layer is cut before Q, K and V (below)
        assert scattered[layer.q] == 2 and scattered[layer.gathered_v] == 2
        assert scattered[layer.gathered_k] == 3  # K^T, [batch, heads, head_dim, S]


def test_alibi_per_layer_cuts_at_q_k_v_and_the_bias_and_gathers_each_layer() -> None:
    # Read from the graph by hand: /Mul_output_0 is -slopes * |i - j| ([2, S, S]), the
    # Transposes of each layer are q.transpose(1, 2), v.transpose(1, 2) and k's two transposes
    # folded into one ([B, 2, 16, S]), /Transpose_3 the context o.transpose(1, 2) [B, S, 2, 16].
    hints = generate(load_index(REAL / "ts_alibi_per_layer.onnx"), GenOptions()).hints
    assert [(t.name, t.seq_len_idx) for t in hints.inputs] == [
        ("/Mul_output_0", 1),
        ("/Transpose_output_0", 2),
        ("/Transpose_1_output_0", 2),
        ("/Transpose_2_output_0", 3),
        ("/Mul_5_output_0", 1),
        ("/Transpose_4_output_0", 2),
        ("/Transpose_5_output_0", 2),
        ("/Transpose_6_output_0", 3),
    ]
    assert [(t.name, t.seq_len_idx) for t in hints.outputs] == [
        ("/Transpose_3_output_0", 1),
        ("/Transpose_7_output_0", 1),
    ]


def test_a_bias_built_once_lets_the_second_layer_stay_split() -> None:
    # The bias reads the embeddings' length only: after the first layer's output is gathered,
    # the residual stream /Add_2 is scattered again, and the second layer is cut as usual.
    hints = generate(load_index(REAL / "ts_alibi_once.onnx"), GenOptions()).hints
    assert ("/Add_2_output_0", 1) in [(t.name, t.seq_len_idx) for t in hints.inputs]
    assert [t.name for t in hints.outputs] == ["/Transpose_3_output_0", "y"]


@pytest.mark.parametrize("name", LENGTH_BIASED)
def test_a_scale_read_from_the_hidden_size_is_no_inexact_cut(name: str, tmp_path) -> None:
    # TorchScript traces (e // heads) ** -0.5 from Shape(x)[2]: a size, not the sequence.
    result = run_cli("gen", REAL / f"{name}.onnx", "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert "no exact cut" not in result.stderr


def test_a_causal_mask_made_from_the_scores_own_shape_is_named() -> None:
    # triu(j - i + 1) of ones(i, j), i and j read from the scores: i is each rank's rows.
    warnings = [
        str(w) for w in generate(load_index(REAL / "ts_einsum_causal.onnx"), GenOptions()).warnings
    ]
    expected = (
        "no exact cut at /layers.0/Cast_3_output_0: it is computed whole and scattered, but "
        "/layers.0/Shape_4 gives it the length of /layers.0/Mul_3_output_0, which each rank "
        "holds a slice of; CP may not be exact"
    )
    assert any(expected in w for w in warnings), warnings
