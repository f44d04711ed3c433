"""ScatterND whose indices are a grid of each axis's own positions (analysis/index_grid.py).

TorchScript writes ``buffer[..., :4] = values`` as a ScatterND whose indices address every
axis by value: on each axis the copy spans whole, a Range over the buffer's length there,
laid along that axis of the grid. Such an axis is written position by position, and a rank
that builds the grid from its own slice's length writes its slice of the whole result. A grid
that is anything else along the sequence (reversed, or sized by another tensor) is not
followed, and onnxruntime shows why: on slices it writes elsewhere.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from index_grids import copy_nodes
from onnx import TensorProto, helper

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex

F = TensorProto.FLOAT
WIDTH, COPIED = 6, 4  # buffer [batch, sequence, 6]; values [batch, sequence, 4] into [..., :4]


def _copy_model(sequence_entry: str = "own", length_of: str | None = None):  # type: ignore[no-untyped-def]
    nodes, constants = copy_nodes(
        "buffer", "values", "out", COPIED, sequence_entry=sequence_entry, length_of=length_of
    )
    inputs = [
        helper.make_tensor_value_info("buffer", F, ["batch", "sequence", WIDTH]),
        helper.make_tensor_value_info("values", F, ["batch", "sequence", COPIED]),
        helper.make_tensor_value_info("other", F, ["batch", "sequence"]),
    ]
    graph = helper.make_graph(
        nodes, "copy", inputs, [helper.make_tensor_value_info("out", F, None)], constants
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _sequence_axes(model):  # type: ignore[no-untyped-def]
    index = GraphIndex(model)
    mapper = AxisMapper(index, ShapeInference(index), "sequence")
    [scatter] = [node for node in index.nodes if node.op_type == "ScatterND"]
    return [mapper.input_axes(scatter, axis) for axis in range(3)]


def _runs_on_slices_agree(model) -> bool:  # type: ignore[no-untyped-def]
    """Two ranks, each running the model on its half of the sequence (the grid built from
    the half's length), joined, against one run over the whole sequence."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {
        "buffer": rng.standard_normal((2, 8, WIDTH)).astype(np.float32),
        "values": rng.standard_normal((2, 8, COPIED)).astype(np.float32),
        "other": rng.standard_normal((2, 8)).astype(np.float32),
    }
    whole = session.run(None, feeds)[0]
    halves = [
        session.run(None, {name: np.array_split(v, 2, axis=1)[part] for name, v in feeds.items()})[
            0
        ]
        for part in range(2)
    ]
    return np.array_equal(np.concatenate(halves, axis=1), whole)


def test_a_copy_whose_grid_is_each_axis_own_positions_is_written_position_by_position() -> None:
    model = _copy_model()
    # The batch and the sequence are spanned whole, by the grid's Ranges; the last axis is
    # addressed at its first 4 positions, by value.
    assert _sequence_axes(model) == [
        [("buffer", 0), ("values", 0)],
        [("buffer", 1), ("values", 1)],
        None,
    ]
    assert _runs_on_slices_agree(model)


@pytest.mark.parametrize(
    ("sequence_entry", "length_of", "agrees_on_slices"),
    [
        # Each rank would write its slice reversed within itself, not the whole reversed.
        ("reversed", None, False),
        # A rank holds its slice of ``other`` too, so its grid is right; but the rule cannot
        # tell from the graph what a rank holds of another tensor.
        ("own", "other", True),
        # The same values as the Range, by a Range the rule does not read.
        ("by_two", None, True),
    ],
)
def test_a_grid_the_rule_cannot_read_as_the_axis_own_positions_is_not_followed(
    sequence_entry: str, length_of: str | None, agrees_on_slices: bool
) -> None:
    model = _copy_model(sequence_entry, length_of)
    assert _sequence_axes(model)[1] is None
    assert _runs_on_slices_agree(model) == agrees_on_slices
