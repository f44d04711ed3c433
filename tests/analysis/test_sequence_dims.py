"""Every sequence dim of the layers (issue 27): an encoder-decoder's decoder runs along a length
of its own, and the axis mapper carries it through the position-wise ops as it carries the
encoder's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import FIXTURES
from onnx import helper as oh
from onnx import numpy_helper

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import detect_attention, sequence_dims
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.loader import load_index

REAL = FIXTURES / "real"


def _reshape_model(target: list[int], out_shape: list[object]) -> onnx.ModelProto:
    """One Reshape of x [batch, target, 32] (a decoder's projection) by a constant target."""
    graph = oh.make_graph(
        [oh.make_node("Reshape", ["x", "to"], ["y"])],
        "decoder_head_split",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "target", 32])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, out_shape)],
        initializer=[numpy_helper.from_array(np.array(target, dtype=np.int64), "to")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    ("target", "out_shape", "out_axis"),
    [
        # The head split: 0 copies batch and target, 32 = 4 heads of 8.
        ([0, 0, 4, 8], ["batch", "target", 4, 8], 1),
        # The tokens flattened for a projection: target is the inner factor of batch*target.
        ([-1, 32], ["batch*target", 32], 0),
    ],
)
def test_a_reshape_carrying_the_second_dim_is_position_wise(
    target: list[int], out_shape: list[object], out_axis: int
) -> None:
    index = GraphIndex(_reshape_model(target, out_shape))
    shapes = ShapeInference(index)
    assert shapes.shape("y") == tuple(out_shape)
    reshape = index.nodes[0]
    # The encoder's length alone: the decoder's axis is no sequence the mapper knows.
    assert AxisMapper(index, shapes, "source").input_axes(reshape, out_axis) is None
    # With the decoder's length as a second sequence dim, the output's axis is x's axis 1.
    both = AxisMapper(index, shapes, "source", ["target"])
    assert both.input_axes(reshape, out_axis) == [("x", 1)]
    assert both.output_axis(reshape, "x", 1) == out_axis
    # The head and head-size axes still carry no sequence.
    assert both.input_axes(reshape, len(out_shape) - 1) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # The encoder's dim first (the first layer's queries), the decoder's after it: read by
        # hand in each export's graph inputs (input_ids and decoder_input_ids; src and tgt).
        ("ts_bart_seq2seq_tiny", ("sequence", "decoder_sequence")),
        ("ts_t5_tiny", ("sequence", "target")),
        ("dynamo_transformer_seq2seq", ("source", "target")),
        # One sequence: a decoder-only export, and an encoder.
        ("ts_gpt2_tiny", ("sequence",)),
        ("ts_bert_tiny", ("sequence",)),
    ],
)
def test_each_layers_own_query_dim_is_a_sequence_dim(name: str, expected: tuple[str, ...]) -> None:
    index = load_index(REAL / f"{name}.onnx")
    shapes = ShapeInference(index)
    assert sequence_dims(shapes, detect_attention(index, shapes)) == expected


def test_a_fixed_query_dim_is_no_second_sequence() -> None:
    # DETR's decoder runs along its 4 object queries (a fixed size): only the encoder's
    # 24 positions (its first layer's queries, fixed in this static export) are the sequence.
    index = load_index(REAL / "dynamo_detr_tiny.onnx")
    shapes = ShapeInference(index)
    assert sequence_dims(shapes, detect_attention(index, shapes)) == (24,)


def test_barts_decoder_head_split_maps_back_to_its_projection() -> None:
    # Read by hand in the graph: the decoder's first self-attention reshapes its q_proj output
    # [batch, decoder_sequence, 32] to [batch, decoder_sequence, 2, 16] (2 heads of 16).
    index = load_index(REAL / "ts_bart_seq2seq_tiny.onnx")
    shapes = ShapeInference(index)
    reshape = index.producer_of("/model/decoder/layers.0/self_attn/Reshape_output_0")
    assert reshape is not None and reshape.op_type == "Reshape"
    projected = "/model/decoder/layers.0/self_attn/q_proj/Add_output_0"
    assert reshape.inputs[0] == projected
    assert shapes.shape(projected) == ("batch", "decoder_sequence", 32)
    assert AxisMapper(index, shapes, "sequence").input_axes(reshape, 1) is None
    mapper = AxisMapper(index, shapes, "sequence", ["decoder_sequence"])
    assert mapper.input_axes(reshape, 1) == [(projected, 1)]
