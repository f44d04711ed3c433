"""Lengths read off a buffer sized by a slice (sharding/lengths.py, issue 27: the default
plan stays exact).

transformers 4's mixture of experts (fixtures/real/ts_olmoe_tf4_moe.onnx) adds each expert's
rows into a zeros buffer of [batch*sequence, hidden], sized by Gathers of the Shape of the
normed hidden states, which a rank holds at its own length. The extension's cut scatters that
buffer, computed whole: the sequence factor of its length is read off the token ids before
their scatter. Carried out as the Polygraphy format can, without the lengths, the same cut
would scatter buffers a rank already holds at its own length: gen's last check
(mixed_lengths) names the first (and the simulation fails that plan). A buffer that is a
zeros-like of a whole Shape (PhiMoE's sparse mixer, fixtures/real/dynamo_phimoe_tiny.onnx) is
not scattered at all: a rank builds it from its own slice. test_lengths_real.py runs the
extensions gen writes through verify at 2 and 4 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from conftest import FIXTURES, run_cli
from graph_reads import shapes_read

from shardcheck import GenOptions, generate, load_index, simulate
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import mentions
from shardcheck.frontier.search import find_frontier
from shardcheck.hints.files import write_hints
from shardcheck.sharding.lengths import mixed_lengths
from shardcheck.sharding.rewrite import shard_model

OLMOE = FIXTURES / "real" / "ts_olmoe_tf4_moe.onnx"
BUFFER = "/model/layers.0/mlp/ConstantOfShape"
PHIMOE = FIXTURES / "real" / "dynamo_phimoe_tiny.onnx"
ZEROS_LIKE = "node_ConstantOfShape_258"


def test_gen_writes_the_extension_that_scatters_the_buffer_whole(tmp_path: Path) -> None:
    result = run_cli("gen", OLMOE, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.rstrip().endswith(".shardcheck.json: 100.0%")
    extension = tmp_path / "h.shardcheck.json"
    multi_device = tmp_path / "md.onnx"
    assert run_cli("shard", OLMOE, extension, "-o", multi_device).exit_code == 0
    graph = onnx.load(multi_device).graph
    # The buffer is computed again with the whole length, then scattered.
    [buffer] = [node for node in graph.node if node.name.startswith(f"{BUFFER}/")]
    [scatter] = [node for node in graph.node if buffer.output[0] in node.input]
    assert scatter.op_type == "DistCollective"
    # Its first entry is batch (axis 0 of the normed hidden states, whole on every rank)
    # times sequence: axis 1 is read off input_ids alone, not off a rank's slice.
    sequence_reads = {read for read in shapes_read(graph, buffer.input[0]) if read[1] == 1}
    assert sequence_reads == {("input_ids", 1)}


def test_the_cut_without_its_lengths_is_kept_out_and_not_exact(tmp_path: Path) -> None:
    index = load_index(OLMOE)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    hints = generate(index, GenOptions(extension=False)).hints
    frontier = find_frontier(index, shapes, layers, lengths_by_reader=True)
    cut = hints.with_changes(inputs=tuple(frontier.inputs), outputs=tuple(frontier.outputs))
    scattered = [index.producer_of(tensor.name) for tensor in cut.inputs]
    assert BUFFER in [node.name for node in scattered if node is not None]
    plain = shard_model(index, cut, shapes=shapes, detected=layers, weights=False)
    # The first buffer of the cut sized by a slice: the padding ScatterND of the causal mask
    # (transformers 4's), scattered before the experts' buffer.
    assert mixed_lengths(index, shapes, cut, plain) == "/model/ScatterND"
    path = tmp_path / "cut.json"
    write_hints(path, cut)
    assert not simulate(OLMOE, path, ranks=2, seq_len=8).ok


def test_a_zeros_like_of_a_slice_is_built_on_the_rank(tmp_path: Path) -> None:
    # The zeros-like is a ConstantOfShape of the whole Shape of the sparse mixer's ArgMax,
    # which a rank computes on its own tokens: it is a rank's already, nothing to scatter.
    model = onnx.load(PHIMOE).graph
    [buffer] = [node for node in model.node if node.name == ZEROS_LIKE]
    assert buffer.op_type == "ConstantOfShape"
    assert run_cli("gen", PHIMOE, "-o", tmp_path / "h.json").exit_code == 0
    extension = tmp_path / "h.shardcheck.json"
    scattered = [tensor["name"] for tensor in json.loads(extension.read_text())["hints"]["inputs"]]
    assert buffer.output[0] not in scattered
    result = run_cli("verify", PHIMOE, extension, "--ranks", "2")
    assert result.exit_code == 0, result.stdout + result.stderr


def test_a_product_is_named_only_where_no_name_continues_it() -> None:
    # The lengths' symbols include products (batch*sequence, dynamo's flattened tokens); a
    # rank's is batch*sequence_on_rank, which must not read as the whole one.
    assert mentions("2*batch*sequence", "batch*sequence")
    assert mentions("batch*sequence", "batch*sequence")
    assert not mentions("batch*sequence_on_rank", "batch*sequence")
    assert not mentions("batch*sequences", "batch*sequence")
    assert not mentions("xbatch*sequence", "batch*sequence")
