"""Lengths read off a buffer sized by a slice (sharding/lengths.py, issue 27: the default
plan stays exact).

PhiMoE's sparse mixer (fixtures/real/dynamo_phimoe_tiny.onnx) scatters into each token's
router scores a ConstantOfShape sized by the Shape of its own ArgMax, [batch*sequence, 1]. The
extension's cut scatters that buffer, computed whole: its whole length is multiplied from the
batch and the length the token ids hold, not read off the buffer itself (which a rank sizes by
its slice). Carried out as the Polygraphy format can, without the lengths, the same cut would
scatter a buffer a rank already holds at its own length: gen's last check (mixed_lengths)
names it (and the simulation fails that plan). test_lengths_real.py runs the
extension gen writes through verify at 2 and 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from conftest import FIXTURES, run_cli

from shardcheck import GenOptions, generate, load_index, simulate
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import mentions
from shardcheck.frontier.search import find_frontier
from shardcheck.hints.files import write_hints
from shardcheck.sharding.lengths import mixed_lengths
from shardcheck.sharding.rewrite import shard_model

PHIMOE = FIXTURES / "real" / "dynamo_phimoe_tiny.onnx"
BUFFER = "node_ConstantOfShape_258"


def test_gen_writes_the_extension_that_scatters_the_buffer_whole(tmp_path: Path) -> None:
    result = run_cli("gen", PHIMOE, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.rstrip().endswith(".shardcheck.json: 100.0%")
    extension = tmp_path / "h.shardcheck.json"
    multi_device = tmp_path / "md.onnx"
    assert run_cli("shard", PHIMOE, extension, "-o", multi_device).exit_code == 0
    graph = onnx.load(multi_device).graph
    producer = {output: node for node in graph.node for output in node.output}
    # The buffer is computed again with the whole length: its shape's first entry, the
    # flattened tokens, is batch times sequence, both read off input_ids before its scatter.
    [buffer] = [node for node in graph.node if node.name.startswith(f"{BUFFER}/")]
    tokens = producer[producer[buffer.input[0]].input[0]]
    assert tokens.op_type == "Mul"
    reads = [producer[name] for name in tokens.input]
    assert [(node.op_type, node.input[0]) for node in reads] == [("Shape", "input_ids")] * 2
    assert sorted(next(a.i for a in node.attribute if a.name == "start") for node in reads) == [
        0,
        1,
    ]


def test_the_cut_without_its_lengths_is_kept_out_and_not_exact(tmp_path: Path) -> None:
    index = load_index(PHIMOE)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    hints = generate(index, GenOptions(extension=False)).hints
    frontier = find_frontier(index, shapes, layers, lengths_by_reader=True)
    cut = hints.with_changes(inputs=tuple(frontier.inputs), outputs=tuple(frontier.outputs))
    scattered = [index.producer_of(tensor.name) for tensor in cut.inputs]
    assert BUFFER in [node.name for node in scattered if node is not None]
    plain = shard_model(index, cut, shapes=shapes, detected=layers, weights=False)
    assert mixed_lengths(index, shapes, cut, plain) == BUFFER
    # Run, that plan is wrong (it fails first at a head split whose target holds the whole
    # length, which the extension's lengths resize too).
    path = tmp_path / "cut.json"
    write_hints(path, cut)
    assert not simulate(PHIMOE, path, ranks=2, seq_len=8).ok


def test_a_product_is_named_only_where_no_name_continues_it() -> None:
    # The lengths' symbols include products (batch*sequence, dynamo's flattened tokens); a
    # rank's is batch*sequence_on_rank, which must not read as the whole one.
    assert mentions("2*batch*sequence", "batch*sequence")
    assert mentions("batch*sequence", "batch*sequence")
    assert not mentions("batch*sequence_on_rank", "batch*sequence")
    assert not mentions("batch*sequences", "batch*sequence")
    assert not mentions("xbatch*sequence", "batch*sequence")
