"""A padding mask broadcast along the queries by the whole length (sharding/lengths.py).

The dynamo exporter sizes XLM by one ``attention_mask.shape[1]``: the positions
(``position_ids[:, -S:]``, expanded over the batch) and the padding mask, viewed
[batch, 1, 1, keys] and expanded to [batch, heads, S, S] by that length twice. A rank needs its
own rows of the mask, over every key: before, gen offered no extension ("node node_masked_fill
of its multi-device model would mix the whole sequence length with a rank's length") and every
projection ran whole. The extension's shard now gives the mask's Expand a rank's length along
the queries alone, and the positions' Expand a rank's along the sequence.
"""

from __future__ import annotations

from pathlib import Path

from conftest import FIXTURES, assert_verified_at_two_and_four_ranks, gen_plan, read_json

from shardcheck import load_index
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

MODEL = FIXTURES / "real" / "dynamo_xlm_tiny.onnx"


def test_the_mask_expand_gets_a_rank_length_and_the_plan_splits(tmp_path: Path) -> None:
    _, extension = gen_plan(MODEL, tmp_path)
    assert extension is not None
    index = load_index(MODEL)
    shapes = ShapeInference(index)
    (mask,) = {mask for layer in detect_attention(index, shapes) for mask in layer.masks}
    expand = index.producer_of(mask)
    assert expand is not None and expand.op_type == "Expand"
    assert expand.name in read_json(extension)["rank_length"]
    plan = make_plan(index, read_hints(extension))
    assert plan.classes["projections"].share_on_slices == 1.0
    assert_verified_at_two_and_four_ranks(MODEL, extension)
