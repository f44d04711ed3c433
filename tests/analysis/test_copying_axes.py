"""Two ops that copy each position along the sequence although they act on its axis
(analysis/axes.py): a Concat along it of one tensor and empty ones (TorchScript's XLM
concatenates each layer's K and V to an empty cache's), and a Conv whose kernel is one position
wide, with stride 1 and no padding (SqueezeBERT's projections). Wider kernels, strides and pads
mix positions.

Each rule is shown two ways, as in test_indexed_axes.py: what the mapper answers, and
onnxruntime running the node on the slices of the axis it maps, which must give the slices of
the whole run.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_indexed_axes import _model, _sliced_runs_agree

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex

F = TensorProto.FLOAT


def _mapper(model):  # type: ignore[no-untyped-def]
    index = GraphIndex(model)
    return index.nodes[0], AxisMapper(index, ShapeInference(index), "sequence")


def test_a_concat_of_one_tensor_copies_it_along_its_axis() -> None:
    node = helper.make_node("Concat", ["k"], ["out"], axis=2)
    model = _model(node, [helper.make_tensor_value_info("k", F, ["batch", 2, "sequence", 4])])
    concat, mapper = _mapper(model)
    assert mapper.input_axes(concat, 2) == [("k", 2)]
    feeds = {"k": np.random.default_rng(0).standard_normal((1, 2, 8, 4)).astype(np.float32)}
    assert _sliced_runs_agree(model, feeds, {"k": 2}, 2)


def test_a_concat_with_an_empty_cache_copies_the_other_tensor() -> None:
    # An empty cache [batch, 2, 0, 4] before the layer's K [batch, 2, sequence, 4].
    node = helper.make_node("Concat", ["cache", "k"], ["out"], axis=-2)
    model = _model(
        node,
        [
            helper.make_tensor_value_info("cache", F, ["batch", 2, 0, 4]),
            helper.make_tensor_value_info("k", F, ["batch", 2, "sequence", 4]),
        ],
    )
    concat, mapper = _mapper(model)
    assert mapper.input_axes(concat, 2) == [("k", 2)]
    rng = np.random.default_rng(1)
    feeds = {
        "cache": np.zeros((1, 2, 0, 4), np.float32),
        "k": rng.standard_normal((1, 2, 8, 4)).astype(np.float32),
    }
    assert _sliced_runs_agree(model, feeds, {"k": 2}, 2)


def test_a_concat_of_two_tensors_along_the_axis_maps_none() -> None:
    node = helper.make_node("Concat", ["past", "k"], ["out"], axis=2)
    model = _model(
        node,
        [
            helper.make_tensor_value_info("past", F, ["batch", 2, "sequence", 4]),
            helper.make_tensor_value_info("k", F, ["batch", 2, "sequence", 4]),
        ],
    )
    concat, mapper = _mapper(model)
    assert mapper.input_axes(concat, 2) is None


def _conv(kernel: int, **attributes: object):  # type: ignore[no-untyped-def]
    # SqueezeBERT's: [batch, hidden 4, sequence] by a weight [4, 2, kernel] in 2 groups.
    weight = helper.make_tensor(
        "w", F, [4, 2, kernel], np.random.default_rng(2).standard_normal(8 * kernel).tolist()
    )
    node = helper.make_node("Conv", ["x", "w"], ["out"], group=2, **attributes)
    return _model(node, [helper.make_tensor_value_info("x", F, ["batch", 4, "sequence"])], [weight])


def test_a_conv_of_kernel_one_is_position_wise_along_the_sequence() -> None:
    model = _conv(1)
    conv, mapper = _mapper(model)
    assert mapper.input_axes(conv, 2) == [("x", 2)]
    assert mapper.input_axes(conv, 1) is None  # the channels: every one mixes a group's
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 4, 8)).astype(np.float32)}
    assert _sliced_runs_agree(model, feeds, {"x": 2}, 2)


@pytest.mark.parametrize(
    ("kernel", "attributes"),
    [
        (3, {"pads": [1, 1]}),  # a convolution over three positions
        (1, {"pads": [1, 0]}),  # a position more before the first
    ],
)
def test_a_conv_that_mixes_or_moves_positions_maps_none(kernel: int, attributes: dict) -> None:
    model = _conv(kernel, **attributes)
    conv, mapper = _mapper(model)
    assert mapper.input_axes(conv, 2) is None
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 4, 8)).astype(np.float32)}
    assert not _sliced_runs_agree(model, feeds, {"x": 2}, 2)


def test_a_strided_conv_maps_none() -> None:
    # Output position i is input position 2·i: not its own, though slices of an even length
    # happen to stride alike.
    conv, mapper = _mapper(_conv(1, strides=[2]))
    assert mapper.input_axes(conv, 2) is None
