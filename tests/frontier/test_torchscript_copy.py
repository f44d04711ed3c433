"""A K written by TorchScript's copy into part of a buffer runs on slices (issue 27).

TorchScript's DeepSeek-V3 builds each head's K in a zero buffer: ``k = zeros(...)``,
``k[..., :16] = k_nope.expand(*k[..., :16].shape)``, a ScatterND whose indices are a grid of
every axis's positions, read off the buffer's Shape (tests/index_grids.py). The model here
has one attention head whose K is such a copy, [batch, sequence, 16] into [batch, sequence,
24]. Two rules let the cut reach the graph input: the sequence is followed through the copy
(analysis/index_grid.py), and the buffer, scattered, is also sliced only for its Shape, which
reads a length (frontier/whole.py). Then the extension's plan runs every projection on
slices, and the simulation on 2 and 4 ranks matches one device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from conftest import assert_verified_at_two_and_four_ranks, checked_model, int64_constant, run_cli
from index_grids import copy_nodes
from onnx import TensorProto
from onnx import helper as oh

from shardcheck import load_index
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

D, WIDTH = 16, 24  # K's width and its buffer's


def _weight(name: str, shape: tuple[int, int], seed: int) -> onnx.TensorProto:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / 4
    return onnx.numpy_helper.from_array(values, name)


def _copied_k_model() -> onnx.ModelProto:
    copy, constants = copy_nodes("buffer", "k_nope", "k", D)
    nodes = [
        oh.make_node("MatMul", ["x", "W_q"], ["q"], name="q_proj"),
        oh.make_node("MatMul", ["x", "W_k"], ["k_raw"], name="k_proj"),
        oh.make_node("MatMul", ["x", "W_v"], ["v"], name="v_proj"),
        # The zero buffer, sized by K's projection.
        oh.make_node("Shape", ["k_raw"], ["k_shape"]),
        oh.make_node("Slice", ["k_shape", "zero", "two"], ["leading"]),
        oh.make_node("Concat", ["leading", "width"], ["buffer_shape"], axis=0),
        oh.make_node("ConstantOfShape", ["buffer_shape"], ["buffer"]),
        # K expanded to the shape of the buffer's part it fills: read for its shape alone.
        oh.make_node("Slice", ["buffer", "zero", "copied", "last"], ["part"]),
        oh.make_node("Shape", ["part"], ["part_shape"]),
        oh.make_node("Expand", ["k_raw", "part_shape"], ["k_nope"]),
        *copy,
        oh.make_node("Transpose", ["k"], ["kT"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "kT"], ["scores"], name="scores"),
        oh.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["attended"], name="context"),
        oh.make_node("MatMul", ["attended", "W_o"], ["y"], name="o_proj"),
    ]
    weights = [
        _weight("W_q", (D, WIDTH), 0),
        _weight("W_k", (D, D), 1),
        _weight("W_v", (D, D), 2),
        _weight("W_o", (D, D), 3),
    ]
    constants += [
        int64_constant("zero", [0]),
        int64_constant("two", [2]),
        int64_constant("width", [WIDTH]),
        int64_constant("copied", [D]),
        int64_constant("last", [-1]),
    ]
    shape = ["batch", "sequence", D]
    graph = oh.make_graph(
        nodes,
        "copied_k",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        weights + constants,
    )
    return checked_model(graph)


def test_a_k_copied_into_part_of_a_buffer_runs_every_projection_on_slices(
    tmp_path: Path,
) -> None:
    model = tmp_path / "copied_k.onnx"
    onnx.save(_copied_k_model(), str(model))
    hints = tmp_path / "hints.json"
    result = run_cli("gen", model, "-o", hints, "-q")
    assert result.exit_code == 0, result.stderr
    # The buffer is computed whole, from the whole length, and scattered: the Polygraphy
    # format cannot say that (its Shape would read a slice's length), the extension does.
    extension = tmp_path / "hints.shardcheck.json"
    document = read_hints(extension)
    assert [(tensor.name, tensor.seq_len_idx) for tensor in document.inputs] == [
        ("x", 1),
        ("buffer", 1),
    ]
    assert [(tensor.name, tensor.seq_len_idx) for tensor in document.outputs] == [("y", 1)]
    plan = make_plan(load_index(model), document, seq_len=64)
    # q (16 -> 24), k, v and o (16 -> 16), 2 FLOPs a multiply-add, 64 tokens: all on slices.
    assert plan.classes["projections"].on_slices == 64 * 2 * D * (WIDTH + 3 * D)
    assert plan.classes["projections"].whole == 0
    assert_verified_at_two_and_four_ranks(model, extension)
