"""The multi-device model that the plans are counted on: the one ``shard`` writes, without the
weights (``shard_model(weights=False)``), which shapes are not computed from."""

from __future__ import annotations

import math

import onnx
import pytest
from conftest import FIXTURES

from shardcheck import load_index
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.tensor_info import MAX_VALUE_ELEMENTS
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.tensors import INTEGER_TYPES
from shardcheck.planning.flop_count import count_flops
from shardcheck.sharding.rewrite import shard_model

REAL = FIXTURES / "real"
# Both write an extension: its lengths are given on the weightless model too.
MODELS = ["dynamo_gpt2_tiny", "ts_alibi_per_layer"]


def _without_initializers(model: onnx.ModelProto) -> bytes:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.initializer[:]
    return copy.SerializeToString()


@pytest.mark.parametrize("name", MODELS)
def test_the_model_counted_is_the_model_written_without_its_weights(name: str) -> None:
    index = load_index(REAL / f"{name}.onnx")
    result = generate(index, GenOptions())
    assert result.extension is not None
    for hints in (result.hints, result.extension.hints):
        written = shard_model(index, hints).model
        counted = shard_model(index, hints, weights=False).model
        # Nodes, inputs, outputs, value_info, opsets: the same bytes.
        assert _without_initializers(counted) == _without_initializers(written)
        pairs = list(zip(written.graph.initializer, counted.graph.initializer, strict=True))
        emptied = 0
        for full, hollow in pairs:
            assert (hollow.name, hollow.data_type, list(hollow.dims)) == (
                full.name,
                full.data_type,
                list(full.dims),
            )
            if full.data_type in INTEGER_TYPES and math.prod(full.dims) <= MAX_VALUE_ELEMENTS:
                assert hollow == full  # a shape's numbers: kept
            else:
                assert not hollow.raw_data and not hollow.float_data and not hollow.int64_data
                emptied += 1
        assert emptied > 0  # the weights are not copied


@pytest.mark.parametrize("name", MODELS)
def test_the_flops_are_the_same_counted_on_the_model_with_its_weights(name: str) -> None:
    index = load_index(REAL / f"{name}.onnx")
    result = generate(index, GenOptions())
    assert result.extension is not None
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    for hints in (result.hints, result.extension.hints):
        with_weights = shard_model(index, hints, shapes=shapes, detected=layers)
        assert count_flops(index, shapes, layers, hints, sharded=with_weights) == count_flops(
            index, shapes, layers, hints
        )
