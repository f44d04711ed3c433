"""K gathered for the nodes that read it beside its layer (the extension's
``gathered_for_readers``, frontier/kv_readers.py).

DeBERTa-v2 multiplies each layer's K heads by its relative position table (position-to-content
scores) before the score MatMul, where the layer gathers K, and indexes those scores along the
queries. Each rank needs them over every key: the extension gathers the K heads for that product
as well, and the projections run on slices. In the TorchScript export each layer's K heads are
``Reshape_3`` ([batch * heads, sequence, head_dim]) and the product is ``MatMul_2``; in the
dynamo export they are ``view_3`` and ``view_17``, read by ``node_bmm_2`` and ``node_bmm_6``
(read off the graphs). DeBERTa (v1) does the same with the K it slices out of a packed
projection.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, gen_plan, run_cli

from shardcheck import load_index
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

REAL = FIXTURES / "real"
TS_LAYER = "/model/encoder/layer.{}/attention/self/"
EXPECTED = {
    "ts_deberta_v2_tiny": [
        {
            "name": TS_LAYER.format(layer) + "Reshape_3_output_0",
            "seq_len_idx": 1,
            "nodes": [TS_LAYER.format(layer) + "MatMul_2"],
        }
        for layer in (0, 1)
    ],
    "dynamo_deberta_v2_tiny": [
        {"name": "view_17", "seq_len_idx": 1, "nodes": ["node_bmm_6"]},
        {"name": "view_3", "seq_len_idx": 1, "nodes": ["node_bmm_2"]},
    ],
    # DeBERTa (v1) slices its K [batch, heads, sequence, head_dim] out of a packed in_proj.
    "ts_deberta_tiny": [
        {
            "name": TS_LAYER.format(layer) + "Slice_1_output_0",
            "seq_len_idx": 2,
            "nodes": [TS_LAYER.format(layer) + "MatMul_2"],
        }
        for layer in (0, 1)
    ],
    "dynamo_deberta_tiny": [
        {"name": "split_1_split_1", "seq_len_idx": 2, "nodes": ["node_matmul_6"]},
        {"name": "split_split_1", "seq_len_idx": 2, "nodes": ["node_matmul_2"]},
    ],
}


def _extension(name: str, tmp_path: Path) -> Path:
    _, extension = gen_plan(REAL / f"{name}.onnx", tmp_path)
    assert extension is not None
    return extension


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_extension_gathers_k_for_the_position_scores(name: str, tmp_path: Path) -> None:
    document = json.loads(_extension(name, tmp_path).read_text())
    assert document["gathered_for_readers"] == EXPECTED[name]


def test_only_the_named_node_reads_the_gathered_k(tmp_path: Path) -> None:
    extension = _extension("ts_deberta_v2_tiny", tmp_path)
    out = tmp_path / "md.onnx"
    assert run_cli("shard", REAL / "ts_deberta_v2_tiny.onnx", extension, "-o", out).exit_code == 0
    graph = onnx.load(str(out)).graph
    producer = {output: node for node in graph.node for output in node.output}
    k_heads = TS_LAYER.format(0) + "Reshape_3_output_0"
    product = next(node for node in graph.node if node.name == TS_LAYER.format(0) + "MatMul_2")
    # Back from the product to the K heads: the gather along axis 1, through axis 0.
    chain, tensor = [], product.input[0]
    while tensor != k_heads:
        node = producer[tensor]
        chain.append(node.op_type)
        tensor = node.input[0]
    assert chain == ["Transpose", "DistCollective", "Transpose"]
    gather = producer[producer[product.input[0]].input[0]]
    assert {a.name: a.s for a in gather.attribute}["collective_operation"] == b"all_gather"
    # The layer's own way to its gather (the Transpose to K^T) reads the slice as it is.
    readers = {node.name for node in graph.node if k_heads in node.input}
    assert TS_LAYER.format(0) + "Transpose_3" in readers


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_without_the_gather_the_split_run_differs(name: str, tmp_path: Path) -> None:
    extension = _extension(name, tmp_path)
    document = json.loads(extension.read_text())
    del document["gathered_for_readers"]
    bare = tmp_path / "bare.shardcheck.json"
    bare.write_text(json.dumps(document))
    result = run_cli("verify", REAL / f"{name}.onnx", bare, "--ranks", "2", "-q")
    assert result.exit_code == 1
    assert "SC201" in result.stdout


def test_the_position_scores_count_as_attention(tmp_path: Path) -> None:
    # Counted at S = 4096 on 2 ranks. Hidden 32, 2 heads of 16, intermediate 64, 2 layers, 8
    # position buckets (16 relative positions). Projections and MLP per layer: Q, K, V and the
    # output by [32, 32] and the MLP's [32, 64] and [64, 32], 2 FLOPs per multiply-add.
    seq, hidden, heads, head_dim, span2, layers = 4096, 32, 2, 16, 16, 2
    projections = layers * (4 * 2 * seq * hidden * hidden + 2 * 2 * seq * hidden * 64)
    # Each layer's position-to-content product, K [heads, S, 16] by [16, 16] per head, runs
    # whole on every rank (over every key, as the scores): attention work, not a projection.
    p2c = layers * 2 * heads * seq * head_dim * span2
    path = REAL / "ts_deberta_v2_tiny.onnx"
    hints = read_hints(str(_extension("ts_deberta_v2_tiny", tmp_path)))
    plan = make_plan(load_index(path), hints, seq_len=seq, ranks=2)
    assert plan.classes["projections"].on_slices == projections
    assert plan.classes["projections"].whole == 0
    assert plan.classes["attention"].whole == p2c


def test_shard_refuses_a_reader_that_does_not_read_the_tensor(tmp_path: Path) -> None:
    extension = _extension("ts_deberta_v2_tiny", tmp_path)
    document = json.loads(extension.read_text())
    document["gathered_for_readers"][0]["nodes"] = [TS_LAYER.format(1) + "MatMul_2"]
    wrong = tmp_path / "wrong.shardcheck.json"
    wrong.write_text(json.dumps(document))
    result = run_cli("shard", REAL / "ts_deberta_v2_tiny.onnx", wrong, "-o", tmp_path / "md.onnx")
    assert result.exit_code == 2
    assert "gathered_for_readers[0]: node '/model/encoder/layer.1/attention/self/MatMul_2'" in (
        result.stderr
    )
    assert "does not read" in result.stderr
    assert not (tmp_path / "md.onnx").exists()


@pytest.mark.parametrize(
    "value, wrong",
    [
        ({"name": "x"}, "expected a list of"),
        (["x"], 'expected a {"name": ..., "seq_len_idx": ..., "nodes": [...]} object'),
        ([{"name": "x", "seq_len_idx": 1}], "object, got"),
        ([{"name": "", "seq_len_idx": 1, "nodes": ["n"]}], "expected a tensor name"),
        ([{"name": "x", "seq_len_idx": -1, "nodes": ["n"]}], "expected an axis"),
        ([{"name": "x", "seq_len_idx": True, "nodes": ["n"]}], "expected an axis"),
        ([{"name": "x", "seq_len_idx": 1, "nodes": []}], "expected node names, each once"),
        ([{"name": "x", "seq_len_idx": 1, "nodes": ["n", "n"]}], "expected node names, each once"),
        (
            [
                {"name": "x", "seq_len_idx": 1, "nodes": ["n"]},
                {"name": "x", "seq_len_idx": 1, "nodes": ["m"]},
            ],
            'names tensor "x" twice',
        ),
    ],
)
def test_a_malformed_gathered_for_readers_is_refused(
    value: object, wrong: str, tmp_path: Path
) -> None:
    extension = _extension("ts_deberta_v2_tiny", tmp_path)
    document = json.loads(extension.read_text())
    document["gathered_for_readers"] = value
    extension.write_text(json.dumps(document))
    result = run_cli("explain", REAL / "ts_deberta_v2_tiny.onnx", extension)
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert str(extension) in line and "gathered_for_readers" in line and wrong in line


def test_diff_names_the_gathered_for_readers(tmp_path: Path) -> None:
    extension = _extension("ts_deberta_v2_tiny", tmp_path)
    document = json.loads(extension.read_text())
    document["gathered_for_readers"] = document["gathered_for_readers"][:1]
    other = tmp_path / "other.shardcheck.json"
    other.write_text(json.dumps(document))
    result = run_cli("diff", extension, other)
    assert result.exit_code == 1
    assert result.stdout.splitlines()[0].startswith(
        f"gathered_for_readers[name={TS_LAYER.format(1)}Reshape_3_output_0]: removed"
    )


def test_the_position_table_is_sliced_with_the_whole_length(tmp_path: Path) -> None:
    # TorchScript's trace of DeBERTa (v1) takes the attention span, the rows of the position
    # table each layer reads, to be the length of Q: on a rank, a slice's. The extension gives
    # that Slice the whole length; without it the split run differs.
    extension = _extension("ts_deberta_tiny", tmp_path)
    document = json.loads(extension.read_text())
    assert document["whole_length"] == [TS_LAYER.format(layer) + "Slice_5" for layer in (0, 1)]
    document["whole_length"] = []
    bare = tmp_path / "bare.shardcheck.json"
    bare.write_text(json.dumps(document))
    result = run_cli("verify", REAL / "ts_deberta_tiny.onnx", bare, "--ranks", "2", "-q")
    assert result.exit_code == 1
    assert "SC201" in result.stdout
