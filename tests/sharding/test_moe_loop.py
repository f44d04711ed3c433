"""transformers 4's experts loop on the ranks' tokens (analysis/selections.py; issue 27).

Each expert takes its tokens by a NonZero of its column of the routing mask, reads their rows
of the flattened tokens (TorchScript: a Gather; dynamo: a GatherND) and adds its output back at
them (a ScatterElements or a ScatterND). On a rank the loop runs on the rank's own tokens: the
rows an expert reads on the ranks together are the rows it reads on one device, each read once.
test_lengths_real.py verifies the default plans at 2 and 4 ranks, batch 1 and 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, gen_plan, run_cli
from expert_rows import values_whole_and_on_ranks

from shardcheck import load_index, simulate
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex, Node

REAL = FIXTURES / "real"
HIDDEN = 32  # fixtures/build_real_exports.py's
EXPORTS = ["ts_olmoe_tf4_moe", "dynamo_olmoe_tf4_moe"]


def _from_non_zero(index: GraphIndex, tensor: str, depth: int = 8) -> bool:
    node = index.producer_of(tensor)
    if node is None or depth == 0:
        return False
    return node.op_type == "NonZero" or any(
        _from_non_zero(index, name, depth - 1) for name in node.inputs if name
    )


def _experts_rows(index: GraphIndex) -> list[tuple[Node, int]]:
    """Each Gather or GatherND that reads an expert's tokens out of the flattened hidden
    states (data of 32 features, indices from a NonZero), with the axis of its rows."""
    shapes = ShapeInference(index)
    found = []
    for node in index.nodes:
        if node.op_type not in ("Gather", "GatherND") or not _from_non_zero(index, node.inputs[1]):
            continue
        data = shapes.shape(node.inputs[0])
        if not data or data[-1] != HIDDEN:
            continue  # the routing weights' picks, not the tokens
        found.append((node, node.attr("axis", 0) if node.op_type == "Gather" else 0))
    return found


@pytest.mark.parametrize("name", EXPORTS)
def test_each_expert_reads_its_tokens_on_the_ranks_once(name: str, tmp_path: Path) -> None:
    model = REAL / f"{name}.onnx"
    index = load_index(model)
    rows = _experts_rows(index)
    assert len(rows) == 8  # 4 experts in each of 2 layers
    outputs = [node.outputs[0] for node, _ in rows]
    whole, per_rank = values_whole_and_on_ranks(model, outputs, tmp_path)
    for (node, axis), output in zip(rows, outputs, strict=True):
        counts = [values[output].shape[axis] for values in per_rank]
        # Every token of the batch routed to this expert, on one rank or the other.
        assert sum(counts) == whole[output].shape[axis], node.name
        assert max(counts) < whole[output].shape[axis], node.name


@pytest.mark.parametrize("name", EXPORTS)
def test_the_default_plan_is_exact_at_batch_2(name: str, tmp_path: Path) -> None:
    model = REAL / f"{name}.onnx"
    _, extension = gen_plan(model, tmp_path)
    assert extension is not None
    result = simulate(model, extension, ranks=2, seq_len=8, dims={"batch": 2})
    assert result.ok, result.summary()


@pytest.mark.parametrize("name", EXPORTS)
def test_explain_says_why_the_experts_are_not_counted(name: str, tmp_path: Path) -> None:
    # Each expert's rows are a NonZero's count: no shape tells it. The experts' MatMuls, 3 per
    # expert (gate, up, down) for 4 experts in each of 2 layers, are left out, and so is all
    # else computed on their rows.
    _, extension = gen_plan(REAL / f"{name}.onnx", tmp_path)
    assert extension is not None
    result = run_cli("explain", REAL / f"{name}.onnx", extension, "--format", "json")
    flops = json.loads(result.stdout)["plan"]["flops"]
    assert flops["uncounted_projections"] == 3 * 4 * 2
    assert flops["uncounted_selected"] == flops["uncounted_nodes"] > 0
    text = run_cli("explain", REAL / f"{name}.onnx", extension).stdout
    assert "all sized by the rows a selection picks" in text


def test_a_model_without_selections_has_none_uncounted_for_them() -> None:
    model = REAL / "dynamo_llama_tiny_gqa.onnx"
    flops = json.loads(run_cli("explain", model, "--format", "json").stdout)["plan"]["flops"]
    assert flops["uncounted_selected"] == 0
