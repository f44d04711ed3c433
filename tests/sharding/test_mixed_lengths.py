"""gen's last check of the extension (sharding/lengths.py's mixed_lengths): a plan whose
multi-device model mixes the whole length with a rank's is not offered (issue 27: the default
plan stays exact).

PhiMoE's sparse mixer (fixtures/real/dynamo_phimoe_tiny.onnx) scatters into each token's
router scores a ConstantOfShape sized by the Shape of its own ArgMax: on a rank, that Shape
reads a slice, so the buffer already has the rank's length, and the cut the extension's
frontier finds would scatter it again. The check names it, and the simulation shows that the
plan it keeps out is wrong indeed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from conftest import FIXTURES, run_cli

from shardcheck import GenOptions, generate, load_index, simulate
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import mentions
from shardcheck.frontier.search import find_frontier
from shardcheck.hints.files import write_hints
from shardcheck.sharding.lengths import length_readers, mixed_lengths
from shardcheck.sharding.rewrite import shard_model

PHIMOE = FIXTURES / "real" / "dynamo_phimoe_tiny.onnx"
BUFFER = "node_ConstantOfShape_258"


def test_gen_keeps_out_the_plan_that_scatters_a_buffer_sized_by_a_slice(tmp_path: Path) -> None:
    result = run_cli("gen", PHIMOE, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert (
        f"no extension written: node {BUFFER} of its multi-device model would mix the whole "
        "sequence length with a rank's length"
    ) in result.stderr
    assert not (tmp_path / "h.shardcheck.json").exists()


def test_the_plan_kept_out_is_not_exact(tmp_path: Path) -> None:
    # The extension gen weighed, made as generation/extension.py makes it.
    index = load_index(PHIMOE)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    hints = generate(index, GenOptions(extension=False)).hints
    frontier = find_frontier(index, shapes, layers, lengths_by_reader=True)
    cut = hints.with_changes(inputs=tuple(frontier.inputs), outputs=tuple(frontier.outputs))
    sharded = shard_model(index, cut, shapes=shapes, detected=layers, weights=False)
    lengths = length_readers(index, shapes, layers, cut, sharded, frontier.region_nodes)
    extended = cut.with_changes(lengths=replace(lengths, for_output=frontier.for_output))
    model = shard_model(index, extended, shapes=shapes, detected=layers, weights=False)
    assert mixed_lengths(index, shapes, extended, model) == BUFFER
    # Run, the ranks' scattered buffer has a quarter of the rows, not half.
    plan = tmp_path / "kept_out.shardcheck.json"
    write_hints(plan, extended)
    result = simulate(PHIMOE, plan, ranks=2, seq_len=8)
    assert not result.ok
    assert "reduce_scatter" in result.summary()


def test_a_product_is_named_only_where_no_name_continues_it() -> None:
    # The lengths' symbols include products (batch*sequence, dynamo's flattened tokens); a
    # rank's is batch*sequence_on_rank, which must not read as the whole one.
    assert mentions("2*batch*sequence", "batch*sequence")
    assert mentions("batch*sequence", "batch*sequence")
    assert not mentions("batch*sequence_on_rank", "batch*sequence")
    assert not mentions("batch*sequences", "batch*sequence")
    assert not mentions("xbatch*sequence", "batch*sequence")
