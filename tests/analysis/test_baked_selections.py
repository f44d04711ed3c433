"""A NonZero count that a trace fixed (analysis/selections.py baked_counts; SC003, issue 27).

transformers 5's eager experts loop over the experts hit, a NonZero of the routing counts over
every token. TorchScript's trace of fixtures/real/ts_qwen2_moe_eager.onnx keeps the 4 experts
its example hit: a Split of that NonZero into 4 fixed parts. Tokens that route to fewer experts
fail there, on one device as on a rank's slice, so the experts cannot run on slices: gen and
verify warn of it and explain names it with the export change. transformers 4's OLMoE loops over
every expert (its NonZeros list tokens, their count free): nothing is baked there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import FIXTURES, run_cli
from onnx import TensorProto, helper, numpy_helper

from shardcheck import load_index
from shardcheck.analysis.selections import baked_counts
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex

REAL = FIXTURES / "real"
EAGER = REAL / "ts_qwen2_moe_eager.onnx"
SPLITS = ["/model/layers.0/mlp/experts/Split", "/model/layers.1/mlp/experts/Split"]


def test_the_splits_of_the_experts_hit_are_found() -> None:
    found = baked_counts(ShapeInference(load_index(EAGER)))
    assert [split.label for split, _ in found] == SPLITS
    # 4 experts, each hit by the example's 16 tokens (top 2 of 4 each).
    assert [len(split.outputs) for split, _ in found] == [4, 4]
    assert {nonzero.op_type for _, nonzero in found} == {"NonZero"}


@pytest.mark.parametrize("name", ["ts_olmoe_tf4_moe", "dynamo_olmoe_tf4_moe", "ts_qwen3_moe_tiny"])
def test_a_loop_over_every_expert_bakes_nothing(name: str) -> None:
    assert baked_counts(ShapeInference(load_index(REAL / f"{name}.onnx"))) == []


def test_tokens_that_route_alike_fail_at_the_split() -> None:
    # What the warning says: one token id everywhere routes every token to the same 2 experts.
    session = ort.InferenceSession(str(EAGER), providers=["CPUExecutionProvider"])
    ones = np.ones((1, 8), dtype=np.int64)
    with pytest.raises(Exception, match=SPLITS[0]):
        session.run(None, {"input_ids": ones * 5, "attention_mask": ones})
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 64, size=(1, 8), dtype=np.int64)
    assert session.run(None, {"input_ids": ids, "attention_mask": ones})[0].shape == (1, 8, 32)


def test_gen_verify_and_explain_name_it(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    result = run_cli("gen", EAGER, "-o", hints)
    assert result.exit_code == 0, result.stderr
    [warning] = [line for line in result.stderr.splitlines() if line.endswith("[SC003]")]
    assert SPLITS[0] in warning and "batched_mm" in warning
    verified = run_cli("verify", EAGER, hints, "--format", "json")
    assert verified.exit_code == 0, verified.stdout
    findings = json.loads(verified.stdout)["findings"]
    [baked] = [finding for finding in findings if finding["code"] == "SC003"]
    assert baked["level"] == "warning"
    assert baked["observed"] == f"Split {SPLITS[0]} into 4"
    plan = json.loads(run_cli("explain", EAGER, "--format", "json").stdout)["plan"]
    assert SPLITS[0] in [blocker["node"] for blocker in plan["blockers"]]


def _split_of_non_zero(sizes_from_shape: bool) -> onnx.ModelProto:
    """x [S] -> NonZero(x > 0) [1, count] -> Transpose [count, 1] -> Split along the count,
    by constant sizes [1, 1] (as a trace writes them) or by the count itself, read at run time."""
    nodes = [
        helper.make_node("Greater", ["x", "zero"], ["positive"]),
        helper.make_node("NonZero", ["positive"], ["picked"]),
        helper.make_node("Transpose", ["picked"], ["rows"], perm=[1, 0]),
    ]
    initializers = [numpy_helper.from_array(np.zeros((), np.float32), "zero")]
    if sizes_from_shape:
        nodes.append(helper.make_node("Shape", ["rows"], ["sizes"], start=0, end=1))
        outputs = ["part"]
    else:
        initializers.append(numpy_helper.from_array(np.array([1, 1], np.int64), "sizes"))
        outputs = ["first", "second"]
    nodes.append(helper.make_node("Split", ["rows", "sizes"], outputs, axis=0))
    graph = helper.make_graph(
        nodes,
        "split_of_non_zero",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["sequence"])],
        [helper.make_tensor_value_info(name, TensorProto.INT64, None) for name in outputs],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(("sizes_from_shape", "baked"), [(False, True), (True, False)])
def test_only_constant_part_sizes_are_baked(sizes_from_shape: bool, baked: bool) -> None:
    index = GraphIndex(_split_of_non_zero(sizes_from_shape))
    assert bool(baked_counts(ShapeInference(index))) is baked
