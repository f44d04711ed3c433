"""Graph outputs that expose what ranks would hold slices of (issue 28, class 7): a hidden state,
a layer's Q, its scores or probabilities, an input passed straight to an output.

Every rank gives out the whole of every graph output: gen's hints gather such a tensor where it
is given out, or keep it whole, and their simulation matches one device. The real exports
(HF BERT with output_hidden_states and output_attentions, a layer giving out its Q and its
input) are simulated in tests/generation/test_gen_real.py.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES
from onnx import TensorProto
from onnx import helper as oh

from shardcheck import GenOptions, generate, load_index, simulate

SEQ = "sequence"
REAL = FIXTURES / "real"


def _layer(given_out: list[str], residual: bool = True) -> onnx.ModelProto:
    """x [batch, S, 8] -> Q, K, V projections, scores, Softmax, context, an output projection
    and (``residual``) x added back: y. ``given_out``: tensors also given out as graph outputs
    (q, scores, probs, context; x itself)."""
    weights = [
        oh.make_tensor(
            name, TensorProto.FLOAT, [8, 8], [0.05 * ((i * (n + 3)) % 11 - 5) for i in range(64)]
        )
        for n, name in enumerate(("wq", "wk", "wv", "wo"))
    ]
    nodes = [
        oh.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        oh.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
        oh.make_node("MatMul", ["x", "wv"], ["v"], name="v_proj"),
        oh.make_node("Transpose", ["k"], ["k_t"], name="k_t", perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "k_t"], ["scores"], name="scores_mm"),
        oh.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["context"], name="context_mm"),
        oh.make_node("MatMul", ["context", "wo"], ["out" if residual else "y"], name="o_proj"),
    ]
    if residual:
        nodes.append(oh.make_node("Add", ["x", "out"], ["y"], name="residual"))
    shapes = {"q": 3, "scores": 3, "probs": 3, "context": 3, "x": 3}
    dims = {3: ["batch", SEQ, 8]}
    outputs = [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, 8])]
    for name in given_out:
        dim = ["batch", SEQ, SEQ] if name in ("scores", "probs") else dims[shapes[name]]
        outputs.append(oh.make_tensor_value_info(name, TensorProto.FLOAT, dim))
    graph = oh.make_graph(
        nodes,
        "exposed",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, 8])],
        outputs,
        initializer=weights,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _gen_and_simulate(
    model: onnx.ModelProto, tmp_path: Path, ranks: int
) -> tuple[dict, dict, bool]:
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    hints = generate(load_index(path), GenOptions()).hints
    result = simulate(path, hints, ranks=ranks, seq_len=8)
    scattered = {t.name: t.seq_len_idx for t in hints.inputs}
    gathered = {t.name: t.seq_len_idx for t in hints.outputs}
    return scattered, gathered, result.ok


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize(
    ("given_out", "residual", "scattered", "gathered"),
    [
        # Nothing given out: x scattered, y gathered (the usual cut, for comparison).
        ([], True, {"x": 1}, {"y": 1}),
        # x as it came in: it stays whole; the projections' outputs are scattered instead, and
        # the output projection's result gathered before x is added back.
        (["x"], True, {"q": 1, "k": 1, "v": 1}, {"out": 1}),
        # The layer's Q given out: computed whole (not scattered), so is the layer, from x
        # whole (the residual Add reads it beside the layer's whole output); K and V are
        # scattered and gathered, nothing else is.
        (["q"], True, {"k": 1, "v": 1}, {}),
        (["q", "probs"], True, {"k": 1, "v": 1}, {}),
        # The probabilities (output_attentions): gathered on their query axis, the context
        # and the rest computed whole, x whole for the residual Add.
        (["probs"], True, {"q": 1, "k": 1, "v": 1}, {"probs": 1}),
        (["probs"], False, {"x": 1}, {"probs": 1}),
        # Scores and probabilities both: the scores gathered, the probabilities then whole.
        (["scores", "probs"], False, {"x": 1}, {"scores": 1}),
    ],
)
def test_a_tensor_given_out_is_gathered_or_kept_whole(
    tmp_path: Path,
    given_out: list[str],
    residual: bool,
    scattered: dict[str, int],
    gathered: dict[str, int],
    ranks: int,
) -> None:
    model = _layer(given_out, residual)
    got_scattered, got_gathered, exact = _gen_and_simulate(model, tmp_path, ranks)
    assert exact
    assert (got_scattered, got_gathered) == (scattered, gathered)


@pytest.mark.parametrize("name", ["ts_bert_exposed", "dynamo_bert_exposed"])
def test_hf_attentions_are_gathered_on_their_query_axis_and_hidden_states_kept_whole(
    name: str,
) -> None:
    # attentions_l is layer l's probabilities [batch, heads, S, S] (HF output_attentions);
    # the hidden states [batch, S, hidden] are then whole, and so never hinted.
    hints = generate(load_index(REAL / f"{name}.onnx"), GenOptions()).hints
    assert [(t.name, t.seq_len_idx) for t in hints.outputs] == [
        ("attentions_0", 2),
        ("attentions_1", 2),
    ]
    hinted = {t.name for t in (*hints.inputs, *hints.outputs)}
    assert not hinted & {"last_hidden_state", "hidden_state_0", "hidden_state_1"}


@pytest.mark.parametrize("name", ["ts_query_given_out", "dynamo_query_given_out"])
def test_a_q_and_an_input_given_out_stay_whole(name: str) -> None:
    hints = generate(load_index(REAL / f"{name}.onnx"), GenOptions()).hints
    hinted = {t.name for t in (*hints.inputs, *hints.outputs)}
    assert not hinted & {"x", "q", "x_out", "y"}
