"""``shard`` with fused hints (``cp-type fused``): TensorRT's multi-device Attention, compared
with Polygraphy 0.53.6's ``multi-device shard`` by structure."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest
from conftest import ANCHORS, FIXTURES, GOLDEN, run_cli
from onnx import helper

from shardcheck import load_index, read_hints
from shardcheck.errors import InputError
from shardcheck.hints.codec import dumps
from shardcheck.hints.model import AttentionLayerHint, FusedAttention
from shardcheck.sharding.rewrite import shard_model

ANCHOR_MODELS = ["attention", "attention_head", "attention_same_qkv", "multi_attention"]
# Polygraphy's own option combinations: shuffles on distinct Q, K, V; none where Q is K is V
# (Polygraphy chains a second Transpose onto the first there).
FUSED_OPTIONS = {
    "attention": ["--k-shuffle", "0", "2", "1", "--is-causal", "--nb-rank", "2"],
    "attention_head": ["--q-shuffle", "1", "0", "2", "--v-shuffle", "1", "0", "2"],
    "attention_same_qkv": ["--is-causal", "--nb-rank", "4"],
    "multi_attention": ["--k-shuffle", "0", "2", "1", "--nb-rank", "2"],
}


def fused_structure(model: onnx.ModelProto, original: set[str]) -> Counter[tuple[Any, ...]]:
    """Each Attention node with its attributes and the chains of Transposes and collectives
    that make its inputs; each collective by the chain it reads; each graph output by its
    chain. Generated names do not appear."""
    producers = {name: node for node in model.graph.node for name in node.output}

    def attributes(node: onnx.NodeProto) -> tuple[Any, ...]:
        return tuple(helper.printable_attribute(a) for a in node.attribute)

    def describe(tensor: str) -> str:
        if tensor in original and (
            tensor not in producers or producers[tensor].op_type not in ("Attention",)
        ):
            return tensor
        node = producers[tensor]
        return f"{node.op_type}{attributes(node)}({', '.join(map(describe, node.input))})"

    items: Counter[tuple[Any, ...]] = Counter()
    for node in model.graph.node:
        if node.op_type in ("Attention", "DistCollective"):
            items[(node.op_type, describe(node.output[0]))] += 1
    for output in model.graph.output:
        items[("output", describe(output.name))] += 1
    return items


def polygraphy(args: list[str]) -> None:
    tools = pytest.importorskip("polygraphy.tools")
    assert tools.main(args) in (0, None)


def fused_parity(model: Path, options: list[str], tmp_path: Path) -> None:
    hints = tmp_path / "hints.json"
    polygraphy(
        ["template", "shard-hints", str(model), "--cp-type", "fused", *options, "-o", str(hints)]
    )
    expected = tmp_path / "polygraphy.onnx"
    polygraphy(["multi-device", "shard", str(model), "-s", str(hints), "-o", str(expected)])
    original = set(load_index(model).all_tensor_names())
    ours = shard_model(load_index(model), read_hints(hints), hints_source=str(hints)).model
    theirs = onnx.load(str(expected), load_external_data=False)
    assert fused_structure(ours, original) == fused_structure(theirs, original)
    assert sum(node.op_type == "Attention" for node in ours.graph.node) >= 1
    # Polygraphy leaves the replaced MatMuls and Softmax behind, cut off (a MatMul without
    # inputs, one without outputs: no valid model); shardcheck removes them.
    assert not any(node.op_type == "Softmax" for node in ours.graph.node)
    assert any(node.op_type == "Softmax" for node in theirs.graph.node)


@pytest.mark.skipif(not ANCHORS.is_dir(), reason="../shared/anchor-models is not present")
@pytest.mark.parametrize("name", ANCHOR_MODELS)
def test_fused_structure_is_polygraphys_on_its_own_models(name: str, tmp_path: Path) -> None:
    fused_parity(ANCHORS / f"{name}.onnx", FUSED_OPTIONS[name], tmp_path)


@pytest.mark.parametrize("name", ANCHOR_MODELS)
def test_fused_structure_is_polygraphys_on_the_equivalent_fixtures(
    name: str, tmp_path: Path
) -> None:
    fused_parity(FIXTURES / f"{name}.onnx", FUSED_OPTIONS[name], tmp_path)


def _fused_hints(path: Path, fused: FusedAttention, q: str | None = None) -> Any:
    hints = read_hints(path)
    layers = tuple(
        AttentionLayerHint(q or layer.q, gather_kv=False, gather_q=False, replace=fused)
        for layer in hints.attention_layers
    )
    return hints.with_changes(attention_layers=layers)


def _attention(model: onnx.ModelProto) -> dict[str, Any]:
    (node,) = [n for n in model.graph.node if n.op_type == "Attention"]
    assert [a.name for a in node.attribute] == ["is_causal", "scale", "TRT_decomposable", "nb_rank"]
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize(
    ("name", "q", "scale"),
    [
        # Divided by 4 between the score MatMul and the Softmax.
        ("scaled_masked_attention", None, 0.25),
        # Pattern 1 named by its Q before the scale, as Polygraphy names it: sqrt(1/sqrt(8)) on
        # Q and on K is 1/sqrt(8) on the scores, inside what the Attention replaces.
        ("sdpa_scaled_attention", "q", 1 / math.sqrt(8)),
        # Named by the score MatMul's Q: the scale is applied before, outside.
        ("sdpa_scaled_attention", None, 1.0),
        ("attention", None, 1.0),
    ],
)
def test_the_scale_written_is_the_one_the_layer_applies(
    name: str, q: str | None, scale: float
) -> None:
    hints = _fused_hints(GOLDEN / f"{name}.json", FusedAttention(False, nb_rank=2), q)
    attributes = _attention(shard_model(load_index(FIXTURES / f"{name}.onnx"), hints).model)
    assert attributes["scale"] == pytest.approx(scale)
    assert (attributes["TRT_decomposable"], attributes["nb_rank"], attributes["is_causal"]) == (
        0,
        2,
        0,
    )


def test_the_replaced_nodes_and_what_only_they_read_are_gone() -> None:
    hints = _fused_hints(GOLDEN / "sdpa_scaled_attention.json", FusedAttention(False), "q")
    model = shard_model(load_index(FIXTURES / "sdpa_scaled_attention.onnx"), hints).model
    ops = Counter(node.op_type for node in model.graph.node)
    # Pattern 1's scale chain (Shape, Slice, Casts, Sqrts, Div, Muls) goes with the layer.
    assert {"MatMul", "Softmax", "Shape", "Sqrt", "Mul", "Div"}.isdisjoint(ops)
    assert ops["Attention"] == 1


def test_a_layer_that_is_no_fused_attention_is_refused_in_one_line(tmp_path: Path) -> None:
    hints = _fused_hints(GOLDEN / "ms_multihead_attention.json", FusedAttention(False))
    with pytest.raises(InputError) as error:
        shard_model(
            load_index(FIXTURES / "ms_multihead_attention.onnx"), hints, hints_source="h.json"
        )
    assert str(error.value).startswith("h.json: attention_layers[0] (q ")
    assert "hint it native (replace: null)" in str(error.value)
    path = tmp_path / "h.json"
    path.write_text(dumps(hints))
    result = run_cli(
        [
            "shard",
            str(FIXTURES / "ms_multihead_attention.onnx"),
            str(path),
            "-o",
            str(tmp_path / "o.onnx"),
        ]
    )
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
