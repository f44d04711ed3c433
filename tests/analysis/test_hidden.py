"""Attention where no hint can name it: If, Loop and Scan bodies, model-local functions.

The hand-made graphs below put one self-attention (MatMul, Softmax, MatMul over x) in a
subgraph; the real export (fixtures/real/ts_attention_in_functions.onnx) has its two layers in
a model-local function, as TorchScript's export_modules_as_functions writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx.inliner
import pytest
from conftest import FIXTURES, run_cli
from onnx import TensorProto, helper

from shardcheck import detect_attention, load_index, verify
from shardcheck.analysis.hidden import hidden_attention
from shardcheck.graph.index import GraphIndex

REAL = FIXTURES / "real"
FUNCTIONS = REAL / "ts_attention_in_functions.onnx"
TRUTH = json.loads((REAL / "TRUTH.json").read_text())["ts_attention_in_functions"]


def _attention_body(name: str, output: str) -> list[onnx.NodeProto]:
    """x (from the outer graph) attending to itself, into ``output``."""
    return [
        helper.make_node("Transpose", ["x"], [f"{name}_kT"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", f"{name}_kT"], [f"{name}_scores"]),
        helper.make_node("Softmax", [f"{name}_scores"], [f"{name}_probs"], axis=-1),
        helper.make_node("MatMul", [f"{name}_probs", "x"], [output]),
    ]


def _model(kind: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", 4])
    if kind == "If":
        then = helper.make_graph(
            _attention_body("then", "y_then"),
            "then",
            [],
            [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, None)],
        )
        other = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y_else"])],
            "else",
            [],
            [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, None)],
        )
        node = helper.make_node(
            "If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other
        )
        inputs = [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), x]
    else:  # Loop: two trips, each attending once (its result carried out)
        body = helper.make_graph(
            [
                helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                *_attention_body("loop", "y_loop"),
            ],
            "body",
            [
                helper.make_tensor_value_info("i", TensorProto.INT64, []),
                helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                helper.make_tensor_value_info("carried", TensorProto.FLOAT, None),
            ],
            [
                helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                helper.make_tensor_value_info("y_loop", TensorProto.FLOAT, None),
            ],
        )
        trips = helper.make_tensor("trips", TensorProto.INT64, [], [2])
        node = helper.make_node("Loop", ["trips", "", "x"], ["y"], name="repeat", body=body)
        inputs = [x]
        graph = helper.make_graph([node], "main", inputs, [y], [trips])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    graph = helper.make_graph([node], "main", inputs, [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("kind", "place"),
    [
        ("If", "the then_branch of If node 'branch'"),
        ("Loop", "the body of Loop node 'repeat'"),
    ],
)
def test_attention_in_a_subgraph_is_named_with_its_place(kind: str, place: str) -> None:
    model = _model(kind)
    onnx.checker.check_model(model)
    found = hidden_attention(model)
    assert [(h.place, h.softmaxes, h.fused, h.in_function) for h in found] == [(place, 1, 0, False)]


def test_attention_in_functions_is_found_only_once_inlined() -> None:
    # Both layers of the PyTorch model are in the function's body: the main graph holds none,
    # and an inlined copy holds both, with the tensors TRUTH.json names.
    index = load_index(FUNCTIONS)
    assert detect_attention(index) == []
    [hidden] = hidden_attention(index.model)
    assert hidden.place.startswith("model-local function '")
    assert "called by 2 nodes" in hidden.place and hidden.in_function
    inlined = onnx.inliner.inline_local_functions(index.model)
    layers = detect_attention(GraphIndex(inlined, source="<inlined>"))
    assert [layer.q for layer in layers] == [n["q_tensor"] for n in TRUTH["attention_nodes"]]


@pytest.mark.parametrize("kind", ["If", "Loop"])
def test_gen_warns_and_verify_fails_where_attention_is_hidden(kind: str, tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.onnx"
    onnx.save(_model(kind), path)
    gen = run_cli("gen", path, "-o", tmp_path / "h.json", "--no-extension")
    assert gen.exit_code == 0, gen.stderr
    assert "[SC129]" in gen.stderr and "export the control flow (If, Loop, Scan) unrolled" in (
        gen.stderr
    )
    checked = run_cli("verify", path, tmp_path / "h.json", "--no-simulate")
    assert checked.exit_code == 1, checked.stdout
    assert "SC129 error" in checked.stdout and "FAIL" in checked.stdout


def test_the_real_export_fails_verify_until_its_functions_are_inlined(tmp_path: Path) -> None:
    gen = run_cli("gen", FUNCTIONS, "-o", tmp_path / "h.json", "--no-extension")
    assert "[SC129]" in gen.stderr and "onnx.inliner.inline_local_functions" in gen.stderr
    report = verify(FUNCTIONS, tmp_path / "h.json", seq_lens=(8, 16), ranks=2)
    assert not report.ok
    assert [f.level for f in report.findings if f.code == "SC129"] == ["error"]
    # What the message says to do works: inlined, both layers are found and sharded exactly.
    inlined = tmp_path / "inlined.onnx"
    onnx.save(onnx.inliner.inline_local_functions(onnx.load(FUNCTIONS)), inlined)
    assert run_cli("gen", inlined, "-o", tmp_path / "i.json", "--no-extension").exit_code == 0
    again = verify(inlined, tmp_path / "i.json", seq_lens=(8, 16), ranks=2)
    assert again.ok, again.render_text()
    assert len(json.loads((tmp_path / "i.json").read_text())["attention_layers"]) == 2
