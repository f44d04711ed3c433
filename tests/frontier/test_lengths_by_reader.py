"""The extension's frontier (``find_frontier(lengths_by_reader=True)``): no length read moves a
cut, since shard gives each node the length it needs (sharding/lengths.py). Without it, the
frontier is the Polygraphy format's, as before."""

from __future__ import annotations

from conftest import FIXTURES

from shardcheck import load_index
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.frontier.search import find_frontier

LLAMA = FIXTURES / "real" / "dynamo_llama_tiny_gqa.onnx"


def frontiers(path):  # type: ignore[no-untyped-def]
    index = load_index(path)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    return (
        find_frontier(index, shapes, layers),
        find_frontier(index, shapes, layers, lengths_by_reader=True),
    )


def test_the_extensions_cut_is_at_the_token_ids_where_the_hints_cut_inside_the_layers() -> None:
    plain, extended = frontiers(LLAMA)
    # Polygraphy's format: every head split is sized by attention_mask.shape[1], which no rank
    # slices, so the cut is after them, in each layer (Q, K and V after the rotary embedding).
    assert "input_ids" not in [t.name for t in plain.inputs]
    assert {"val_220", "val_222", "val_225"} <= {t.name for t in plain.inputs}
    assert [t.name for t in plain.outputs] == ["transpose_3", "transpose_7"]
    # The extension's: the token ids, the causal mask over its queries and the rotary cos and
    # sin tables, computed whole; the output gathered at the end.
    assert [(t.name, t.seq_len_idx) for t in extended.inputs] == [
        ("input_ids", 1),
        ("bitwise_and", 2),
        ("unsqueeze_14", 2),
        ("unsqueeze_15", 2),
    ]
    assert [(t.name, t.seq_len_idx) for t in extended.outputs] == [("last_hidden_state", 1)]
    assert plain.warnings == extended.warnings == []


def test_the_region_runs_every_projection_of_the_extension() -> None:
    plain, extended = frontiers(LLAMA)
    index = load_index(LLAMA)
    matmuls = {node.index for node in index.nodes if node.op_type == "MatMul"}
    # Both regions hold the nodes before the first layer's scores; the extension's holds the
    # first layer's projections (node_linear*), the hints' none of them.
    names = {index.nodes[at].name for at in extended.region_nodes & matmuls}
    assert {"node_linear", "node_linear_1", "node_linear_2"} <= names
    assert not {index.nodes[at].name for at in plain.region_nodes & matmuls} & names
