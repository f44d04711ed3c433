"""The extension's traced lengths (sharding/traced.py): TorchScript exports whose Reshapes hold
the length the trace ran at split their projections too (issue 27, item 2).

nn.MultiheadAttention's traced export writes ``k.view(src_len, bsz * num_heads, head_dim)`` with
src_len a number, so the model runs at that length only and no rank's slice may reach those
Reshapes in Polygraphy's multi-device model: its hints cut inside the layers. The extension
names them; shard makes each read its length from its input first.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import FIXTURES, run_cli

from shardcheck import load_index
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan
from shardcheck.sharding.traced import NAME_PART, traced_entries, untraced_model

REAL = FIXTURES / "real"
# The Reshapes of each export that the trace wrote its length into, read off the ONNX graph
# by hand (nn.MultiheadAttention's views of K and V: Reshape_4 and Reshape_5 of each layer,
# whose targets are Concats of the constant 8 with the batch times the heads, and 16).
TRACED = {
    "ts_transformer_encoder": [
        "/layers.0/self_attn/Reshape_4",
        "/layers.0/self_attn/Reshape_5",
        "/layers.1/self_attn/Reshape_4",
        "/layers.1/self_attn/Reshape_5",
    ],
    "ts_mha_seq_first": ["/attn/Reshape_4", "/attn/Reshape_5"],
}
# Where each export's sequence axis is: x [B, S, E] (batch_first) and x [S, B, E].
SEQUENCE_AXIS = {"ts_transformer_encoder": 1, "ts_mha_seq_first": 0}
TRACED_LENGTH = 8


def gen_extension(name: str, tmp_path: Path) -> Path:
    hints = tmp_path / f"{name}.json"
    result = run_cli("gen", REAL / f"{name}.onnx", "-o", hints)
    assert result.exit_code == 0, result.stderr
    extension = tmp_path / f"{name}.shardcheck.json"
    assert extension.exists(), result.stderr
    return extension


@pytest.mark.parametrize("name", sorted(TRACED))
def test_gen_names_the_traced_reshapes_and_cuts_at_the_input(name: str, tmp_path: Path) -> None:
    document = json.loads(gen_extension(name, tmp_path).read_text())
    assert document["traced_length"] == TRACED[name]
    axis = SEQUENCE_AXIS[name]
    assert [(t["name"], t["seq_len_idx"]) for t in document["hints"]["inputs"]] == [("x", axis)]
    assert [(t["name"], t["seq_len_idx"]) for t in document["hints"]["outputs"]] == [("y", axis)]


@pytest.mark.parametrize("name", sorted(TRACED))
def test_the_extension_splits_the_projections_and_stays_exact(name: str, tmp_path: Path) -> None:
    extension = gen_extension(name, tmp_path)
    model = REAL / f"{name}.onnx"
    plan = make_plan(load_index(model), read_hints(extension), seq_len=TRACED_LENGTH)
    assert plan.classes["projections"].share_on_slices == 1.0
    for ranks in (2, 4):
        for batch in (1, 2):
            result = run_cli(
                "verify", model, extension, "--ranks", ranks, "--dim", f"batch={batch}"
            )
            assert result.exit_code == 0, (ranks, batch, result.stdout, result.stderr)
            assert f"{ranks} simulated ranks at length {TRACED_LENGTH} match" in result.stdout


def test_the_polygraphy_hints_beside_it_stay_inside_the_layers(tmp_path: Path) -> None:
    gen_extension("ts_transformer_encoder", tmp_path)
    hints = json.loads((tmp_path / "ts_transformer_encoder.json").read_text())
    assert "x" not in {tensor["name"] for tensor in hints["inputs"]}
    assert "traced_length" not in hints


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_the_untraced_model_computes_the_same_and_runs_at_other_lengths() -> None:
    index = load_index(REAL / "ts_transformer_encoder.onnx")
    shapes = ShapeInference(index)
    entries = traced_entries(index, shapes, detect_attention(index, shapes))
    assert entries is not None and sorted(entries) == TRACED["ts_transformer_encoder"]
    # Each target is [8, 2 * batch, 16]: the length is its first entry, the input's first axis.
    assert {(e.entry, e.input_axis, e.factor) for e in entries.values()} == {(0, 0, 1)}
    untraced = untraced_model(index, entries)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, TRACED_LENGTH, 32)).astype(np.float32)
    np.testing.assert_array_equal(_run(untraced, x), _run(index.model, x))
    longer = rng.standard_normal((2, 2 * TRACED_LENGTH, 32)).astype(np.float32)
    with pytest.raises(Exception, match="Reshape"):
        _run(index.model, longer)
    assert _run(untraced, longer).shape == (2, 2 * TRACED_LENGTH, 32)


def test_shard_writes_the_traced_reshapes_reading_their_input(tmp_path: Path) -> None:
    extension = gen_extension("ts_transformer_encoder", tmp_path)
    output = tmp_path / "md.onnx"
    result = run_cli("shard", REAL / "ts_transformer_encoder.onnx", extension, "-o", output)
    assert result.exit_code == 0, result.stderr
    nodes = {node.name: node for node in onnx.load(output).graph.node}
    for name in TRACED["ts_transformer_encoder"]:
        assert nodes[name].input[1] == f"{name}{NAME_PART}/target"
        assert nodes[f"{name}{NAME_PART}/Shape"].op_type == "Shape"


def test_a_traced_length_that_names_another_node_is_refused(tmp_path: Path) -> None:
    extension = gen_extension("ts_transformer_encoder", tmp_path)
    document = json.loads(extension.read_text())
    document["traced_length"] = ["/layers.0/self_attn/Reshape_2"]  # a Reshape with no number
    extension.write_text(json.dumps(document))
    output = tmp_path / "md.onnx"
    result = run_cli("shard", REAL / "ts_transformer_encoder.onnx", extension, "-o", output)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert str(extension) in result.stderr
    assert "'/layers.0/self_attn/Reshape_2' is not a Reshape" in result.stderr
    assert not output.exists()


@pytest.mark.parametrize("value", ["x", [1], ["a", "a"]])
def test_a_malformed_traced_length_is_one_line(value: object, tmp_path: Path) -> None:
    extension = gen_extension("ts_transformer_encoder", tmp_path)
    document = json.loads(extension.read_text())
    document["traced_length"] = value
    extension.write_text(json.dumps(document))
    result = run_cli("verify", REAL / "ts_transformer_encoder.onnx", extension)
    assert result.exit_code == 2
    assert "traced_length" in result.stderr and result.stderr.count("\n") == 1


def test_extensions_without_traced_lengths_do_not_write_the_key(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    assert run_cli("gen", REAL / "dynamo_llama_tiny_gqa.onnx", "-o", hints).exit_code == 0
    document = json.loads((tmp_path / "h.shardcheck.json").read_text())
    assert "traced_length" not in document


def test_an_encoder_decoder_untraces_both_lengths(tmp_path: Path) -> None:
    # nn.Transformer traced at source 8 and target 4: the encoder's and the decoder's
    # cross-attention views hold 8, the decoder's self-attention views 4.
    name = "ts_transformer_seq2seq"
    extension = gen_extension(name, tmp_path)
    document = json.loads(extension.read_text())
    assert document["traced_length"] == [
        "/transformer/encoder/layers.0/self_attn/Reshape_4",
        "/transformer/encoder/layers.0/self_attn/Reshape_5",
        "/transformer/decoder/layers.0/multihead_attn/Reshape_4",
        "/transformer/decoder/layers.0/multihead_attn/Reshape_5",
        "/transformer/decoder/layers.0/self_attn/Reshape_4",
        "/transformer/decoder/layers.0/self_attn/Reshape_5",
    ]
    inputs = [(t["name"], t["seq_len_idx"]) for t in document["hints"]["inputs"]]
    assert inputs == [("src", 1), ("tgt", 1)]
    model = REAL / f"{name}.onnx"
    for ranks in (2, 4):
        result = run_cli(
            "verify", model, extension, "--ranks", ranks, "--dim", "batch=2",
            "--seq-lens", "8,16", "--seq-len", "target=4,8",
        )  # fmt: skip
        assert result.exit_code == 0, (ranks, result.stdout, result.stderr)
        assert f"{ranks} simulated ranks at length 8 match" in result.stdout
