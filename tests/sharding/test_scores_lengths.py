"""Reshapes of the scores sized by the whole length (sharding/lengths.py, issue 27).

The dynamo exporter sizes Bloom's scores by attention_mask's length: inside each layer it
reshapes them to [batch, heads, queries, -1] for the mask's Add and back to [batch * heads,
queries, keys] after the Softmax (fixtures/real/dynamo_bloom_tiny.onnx). On a rank the queries
are a slice and the keys whole, so the extension's shard gives such a Reshape a rank's length
along its queries, and leaves a whole length along its keys as it is.

The model here: one head over x [batch, sequence, 8]; its scores reshaped to [batch, 1,
mask.shape[1], -1] (the queries' length whole: to scale) and, after the Softmax, to [batch,
-1, mask.shape[1]] (the keys' length whole: to keep). The hints' cut is the extension's;
gen writes the extension all the same, as it makes exact what the hints do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from conftest import assert_verified_at_two_and_four_ranks, checked_model, int64_constant, run_cli
from onnx import TensorProto
from onnx import helper as oh

D = 8


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array((rng.standard_normal((D, D)) / 3).astype(np.float32), name)
        for name in ("W_q", "W_k", "W_v")
    ]
    nodes = [
        *(oh.make_node("MatMul", ["x", f"W_{p}"], [p], name=f"{p}_proj") for p in "qkv"),
        oh.make_node("Shape", ["mask"], ["batch"], start=0, end=1),
        oh.make_node("Shape", ["mask"], ["length"], start=1, end=2),
        oh.make_node("Transpose", ["k"], ["kT"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "kT"], ["scores"], name="scores"),
        oh.make_node("Concat", ["batch", "one", "length", "rest"], ["by_head"], axis=0),
        oh.make_node("Reshape", ["scores", "by_head"], ["heads"], name="queries_whole"),
        oh.make_node("Softmax", ["heads"], ["probs"], axis=-1),
        oh.make_node("Concat", ["batch", "rest", "length"], ["back"], axis=0),
        oh.make_node("Reshape", ["probs", "back"], ["folded"], name="keys_whole"),
        oh.make_node("MatMul", ["folded", "v"], ["y"], name="context"),
    ]
    graph = oh.make_graph(
        nodes,
        "scores_lengths",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", D]),
            oh.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", D])],
        [*weights, int64_constant("one", [1]), int64_constant("rest", [-1])],
    )
    return checked_model(graph)


def test_a_reshape_of_the_scores_gets_a_rank_length_along_its_queries_alone(
    tmp_path: Path,
) -> None:
    model = tmp_path / "scores_lengths.onnx"
    onnx.save(_model(), str(model))
    result = run_cli("gen", model, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    # The Polygraphy format's cut is not exact: the first Reshape has the whole length.
    assert "queries_whole is sized by the length of mask" in result.stderr
    extension = tmp_path / "h.shardcheck.json"
    document = json.loads(extension.read_text())
    assert document["rank_length"] == ["queries_whole"]
    # The extension's cut is the hints' own: gen writes it because it is exact where they
    # are not, at the same share.
    hints = json.loads((tmp_path / "h.json").read_text())
    assert [(t["name"], t["seq_len_idx"]) for t in document["hints"]["inputs"]] == [("x", 1)]
    assert document["hints"]["inputs"] == hints["inputs"]
    assert document["hints"]["outputs"] == hints["outputs"]
    assert_verified_at_two_and_four_ranks(model, extension)
    # Without the rank's length the same cut fails the simulation.
    document["rank_length"] = []
    unscaled = tmp_path / "unscaled.shardcheck.json"
    unscaled.write_text(json.dumps(document))
    failed = run_cli("verify", model, unscaled, "--ranks", 2, "-q")
    assert failed.exit_code == 1, (failed.stdout, failed.stderr)
