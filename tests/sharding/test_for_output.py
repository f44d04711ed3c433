"""Graph outputs that expose slices, gathered for the graph output alone (the extension's
``gathered_for_output``, issue 27): the layers keep computing on the ranks' slices.

HF BERT with ``output_hidden_states`` and ``output_attentions`` gives out the hidden states
between the layers and each layer's attention probabilities; the QueryGivenOut block gives out
its Q and its input x beside its result. The Polygraphy format gathers a tensor for all its
consumers, so its hints compute the layers whole from there (0% of the projections on slices);
the extension's shard gathers them for the graph output only. That its plan runs the
projections on slices (counted on shard's model) and passes verify at 2 and 4 ranks, batch 1
and 2, is tests/sharding/test_lengths_real.py's test, which lists the four.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, gen_plan, run_cli

REAL = FIXTURES / "real"
# What each export gives out that its layers read on: read off the PyTorch definitions by hand.
# BERT's hidden states are [B, S, H] (the sequence on axis 1): the embeddings' output and each
# layer's; last_hidden_state is the last layer's, which hidden_state_2 copies (read by no
# node, so gathered as in the hints). The probabilities are [B, heads, Sq, Sk]: axis 2, the
# queries. QueryGivenOut's Q is [B, heads, S, D] (axis 2); x_out copies the input, which is the
# cut, and is read by nothing, so it is gathered as in the hints.
GIVEN_OUT = {
    "ts_bert_exposed": ["hidden_state_0", "attentions_0", "hidden_state_1", "attentions_1"],
    "dynamo_bert_exposed": ["hidden_state_0", "attentions_0", "hidden_state_1", "attentions_1"],
    "ts_query_given_out": ["q"],
    "dynamo_query_given_out": ["q"],
}
AXES = {
    "hidden_state_0": 1,
    "hidden_state_1": 1,
    "last_hidden_state": 1,
    "attentions_0": 2,
    "attentions_1": 2,
    "q": 2,
}


def gen_both(name: str, tmp_path: Path) -> tuple[Path, Path]:
    """gen's hints of ``name`` and the extension beside them."""
    hints, extension = gen_plan(REAL / f"{name}.onnx", tmp_path)
    assert extension is not None
    return hints, extension


@pytest.mark.parametrize("name", sorted(GIVEN_OUT))
def test_the_extension_gathers_the_exposed_tensors_for_the_output_alone(
    name: str, tmp_path: Path
) -> None:
    _, extension = gen_both(name, tmp_path)
    document = json.loads(extension.read_text())
    named = document["gathered_for_output"]
    # The BERTs' last_hidden_state too, which the copy hidden_state_2 reads.
    assert [tensor for tensor in named if tensor != "last_hidden_state"] == GIVEN_OUT[name]
    axes = {tensor["name"]: tensor["seq_len_idx"] for tensor in document["hints"]["outputs"]}
    for tensor in named:
        assert axes[tensor] == AXES[tensor]


@pytest.mark.parametrize("name", sorted(GIVEN_OUT))
def test_the_hints_beside_it_are_the_polygraphy_ones(name: str, tmp_path: Path) -> None:
    hints, _ = gen_both(name, tmp_path)
    alone = tmp_path / "alone.json"
    result = run_cli("gen", REAL / f"{name}.onnx", "-o", alone, "--no-extension", "-q")
    assert result.exit_code == 0, result.stderr
    assert hints.read_bytes() == alone.read_bytes()
    assert "gathered_for_output" not in hints.read_text()


def test_only_the_graph_output_takes_the_gathered_tensor(tmp_path: Path) -> None:
    _, extension = gen_both("ts_query_given_out", tmp_path)
    multi_device = tmp_path / "md.onnx"
    result = run_cli("shard", REAL / "ts_query_given_out.onnx", extension, "-o", multi_device)
    assert result.exit_code == 0, result.stderr
    graph = onnx.load(multi_device).graph
    assert [output.name for output in graph.output] == [
        "y/all_gather", "q/all_gather", "x_out/all_gather",
    ]  # fmt: skip
    nodes = {node.name: node for node in graph.node}
    # q [B, H, S, D] gathered on axis 2, through the Transposes that bring it to axis 0 ...
    assert list(nodes["q/all_gather/axis2_to_0"].input) == ["q"]
    assert list(nodes["q/all_gather"].input) == ["q/all_gather/on_axis0"]
    # ... while the layer's Mul by the scale and its Shape still read the rank's q.
    assert nodes["/block/Mul"].input[0] == "q"
    assert nodes["/block/Shape_9"].input[0] == "q"
    readers = {node.name for node in graph.node if "q/all_gather" in node.input}
    assert readers == set()  # the graph output alone


def _edited(extension: Path, key: str, value: object) -> None:
    document = json.loads(extension.read_text())
    document[key] = value
    extension.write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("q", "expected a list of tensor names"),
        ([1], "expected a list of tensor names"),
        (["q", "q"], 'names tensor "q" twice'),
        (["x"], '"x" is not among the hints\' outputs'),
    ],
)
def test_a_malformed_gathered_for_output_is_one_line(
    value: object, problem: str, tmp_path: Path
) -> None:
    _, extension = gen_both("ts_query_given_out", tmp_path)
    _edited(extension, "gathered_for_output", value)
    result = run_cli("verify", REAL / "ts_query_given_out.onnx", extension)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert f"{extension}: gathered_for_output: " in result.stderr
    assert problem in result.stderr


def test_a_gathered_for_output_that_is_no_graph_output_is_refused(tmp_path: Path) -> None:
    _, extension = gen_both("ts_query_given_out", tmp_path)
    document = json.loads(extension.read_text())
    inner = "/block/k_proj/MatMul_output_0"  # K's projection: read by the layer, not given out
    document["hints"]["outputs"].append(
        {"name": inner, "seq_len_idx": 1, "rank": 3, "polygraphy_class": "ShardTensor"}
    )
    document["gathered_for_output"] = ["q", inner]
    extension.write_text(json.dumps(document))
    output = tmp_path / "md.onnx"
    result = run_cli("shard", REAL / "ts_query_given_out.onnx", extension, "-o", output)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert str(extension) in result.stderr and "gathered_for_output" in result.stderr
    assert f"{inner!r} is not a graph output" in result.stderr
    assert not output.exists()


def test_diff_names_an_output_no_longer_gathered_for_the_output_alone(tmp_path: Path) -> None:
    _, extension = gen_both("ts_bert_exposed", tmp_path)
    document = json.loads(extension.read_text())
    document["gathered_for_output"].remove("attentions_1")
    edited = tmp_path / "edited.shardcheck.json"
    edited.write_text(json.dumps(document))
    result = run_cli("diff", extension, edited)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        'gathered_for_output[tensor=attentions_1]: removed (was "output")'
    ]
