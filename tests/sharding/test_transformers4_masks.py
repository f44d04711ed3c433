"""The masks of transformers 4's dynamo exports (sharding/lengths.py, analysis/layer_insides.py;
issue 27: the default plan splits the projections and stays exact).

transformers 4 builds a decoder's mask as ``causal [S, S] And padding [B, 1, S]``, viewed as
[B, 1, S, S] by ``attention_mask.shape[1]`` twice (fixtures/real/dynamo_llama_tf4_gqa.onnx,
dynamo_gpt2_tf4.onnx), and BERT's padding mask as an Expand to [B, 1, S, S], then ``1 - mask``
and a masked_fill's Where (dynamo_bert_tf4.onnx). The extension scatters the causal rows; a
rank's view of them needs a rank's length at the queries' entry of the view, the first of the
two whole lengths. transformers 4.46 fills the padding into its causal mask by a ScatterND
sized by a slice's Shape, and each layer slices the mask along the keys by its K's length
(ts_llama_tf446_gqa.onnx): the mask, scattered, is computed whole, and the keys are whole.
test_lengths_real.py verifies the plans at 2 and 4 ranks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from conftest import FIXTURES, gen_plan

from shardcheck import load_index, simulate
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.layer_insides import mask_broadcasts
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.files import read_hints, write_hints
from shardcheck.sharding.lengths import mixed_lengths
from shardcheck.sharding.rewrite import shard_model

REAL = FIXTURES / "real"


def _mask_view(index: GraphIndex, mask: str) -> str:
    """The Reshape that a layer's mask (the Where before the scores) is made from."""
    where = index.producer_of(mask)
    assert where is not None and where.op_type == "Where"
    view = index.producer_of(where.inputs[0])
    assert view is not None and view.op_type == "Reshape"
    return view.name


def test_the_decoders_mask_view_gets_a_ranks_length_at_its_queries(tmp_path: Path) -> None:
    model = REAL / "dynamo_llama_tf4_gqa.onnx"
    index = load_index(model)
    shapes = ShapeInference(index)
    [mask] = {mask for layer in detect_attention(index, shapes) for mask in layer.masks}
    view = _mask_view(index, mask)
    # The view's target is [batch, 1, sequence, sequence]: two entries of the whole length.
    assert shapes.shape(mask) == ("batch", 1, "sequence", "sequence")
    _, extension = gen_plan(model, tmp_path)
    assert extension is not None
    lengths = read_hints(extension).lengths
    assert lengths is not None
    assert view in lengths.rank
    # On a rank the mask is the rank's rows of every key: [batch, 1, sequence / 2, sequence].
    result = simulate(model, extension, ranks=2, seq_len=8, dims={"batch": 2})
    assert result.ok, result.summary()


def test_berts_padding_mask_is_found_through_its_masked_fill() -> None:
    index = load_index(REAL / "dynamo_bert_tf4.onnx")
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    # Where(Cast(1 - Cast(Expand(Unsqueeze(attention_mask))))): the Expand broadcasts
    # [batch, 1, 1, sequence] to [batch, 1, sequence, sequence], queries on axis 2.
    [expand] = [
        node
        for node in index.nodes
        if node.op_type == "Expand"
        and (unsqueeze := index.producer_of(node.inputs[0])) is not None
        and unsqueeze.op_type == "Unsqueeze"
        and unsqueeze.inputs[0] == "attention_mask"
    ]
    assert shapes.shape(expand.inputs[0]) == ("batch", 1, 1, "sequence")
    assert mask_broadcasts(index, shapes, layers) == {expand.name: 2}


def test_a_view_left_at_the_whole_length_is_named_and_not_exact(tmp_path: Path) -> None:
    # The extension as gen wrote it before the view got its rank's length: a Reshape of a
    # rank's rows to the whole length, which no rank can run.
    model = REAL / "dynamo_gpt2_tf4.onnx"
    index = load_index(model)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    [mask] = {mask for layer in layers for mask in layer.masks}
    view = _mask_view(index, mask)
    _, extension = gen_plan(model, tmp_path)
    assert extension is not None
    hints = read_hints(extension)
    assert hints.lengths is not None and view in hints.lengths.rank
    rank = tuple(name for name in hints.lengths.rank if name != view)
    without = hints.with_changes(lengths=replace(hints.lengths, rank=rank))
    sharded = shard_model(index, without, shapes=shapes, detected=layers, weights=False)
    assert mixed_lengths(index, shapes, without, sharded) == view
    path = tmp_path / "without.shardcheck.json"
    write_hints(path, without)
    assert not simulate(model, path, ranks=2, seq_len=8).ok


def test_the_scattered_mask_is_computed_whole_and_sliced_by_the_whole_keys(
    tmp_path: Path,
) -> None:
    model = REAL / "ts_llama_tf446_gqa.onnx"
    index = load_index(model)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    _, extension = gen_plan(model, tmp_path)
    assert extension is not None
    hints = read_hints(extension)
    assert hints.lengths is not None
    # The mask the extension scatters along its queries is the ScatterND's output.
    [scatter] = [
        node
        for tensor in hints.inputs
        if (node := index.producer_of(tensor.name)) is not None and node.op_type == "ScatterND"
    ]
    assert scatter.name in hints.lengths.whole
    # Each layer's mask is a Slice of it along the keys, by the length of that layer's K.
    key_slices = [index.producer_of(mask) for layer in layers for mask in layer.masks]
    assert [node.op_type for node in key_slices if node is not None] == ["Slice", "Slice"]
    for node in key_slices:
        assert node is not None and node.inputs[0] == scatter.outputs[0]
        assert node.name in hints.lengths.whole
    result = simulate(model, extension, ranks=2, seq_len=8, dims={"batch": 2})
    assert result.ok, result.summary()
    # Without the whole length, the mask a rank scatters would hold a rank's length already.
    whole = tuple(name for name in hints.lengths.whole if name != scatter.name)
    without = hints.with_changes(lengths=replace(hints.lengths, whole=whole))
    sharded = shard_model(index, without, shapes=shapes, detected=layers, weights=False)
    assert mixed_lengths(index, shapes, without, sharded) == scatter.name
