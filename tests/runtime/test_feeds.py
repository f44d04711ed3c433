"""Inputs for onnxruntime runs: which dims, which values; the sessions that run them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, GOLDEN
from onnx import TensorProto, helper

from shardcheck import load_index, read_hints
from shardcheck.errors import InputError
from shardcheck.hints.model import ShardHints, ShardTensor
from shardcheck.runtime.feeds import embedding_table_size, make_feeds, padded_positions
from shardcheck.runtime.sessions import error_text, failed_node, make_session, run_model
from shardcheck.runtime.sizes import resolve_dims

REAL = FIXTURES / "real"


def hints_with_inputs(*tensors: ShardTensor) -> ShardHints:
    return ShardHints(inputs=tensors)


def test_the_sequence_dim_is_the_hinted_axis_of_a_graph_input() -> None:
    index = load_index(REAL / "ts_gpt2_tiny.onnx")
    hints = hints_with_inputs(ShardTensor("input_ids", 1))
    assert resolve_dims(index, hints, 16, {}) == {"batch": 1, "sequence": 16}


def test_the_sequence_dim_of_an_inner_tensor_comes_from_shape_propagation() -> None:
    index = load_index(REAL / "ts_gpt2_tiny.onnx")
    hints = hints_with_inputs(ShardTensor("/model/Add_output_0", 1, 3))
    assert resolve_dims(index, hints, 8, {}) == {"batch": 1, "sequence": 8}


def test_user_dims_win_and_unknown_ones_are_refused() -> None:
    index = load_index(REAL / "ts_gpt2_tiny.onnx")
    hints = hints_with_inputs(ShardTensor("input_ids", 1))
    assert resolve_dims(index, hints, 8, {"batch": 3}) == {"batch": 3, "sequence": 8}
    with pytest.raises(InputError, match=r"--dim batchsize=2: the model's inputs have no dim"):
        resolve_dims(index, hints, 8, {"batchsize": 2})


def test_other_dims_default_to_1_when_batch_like_else_2(tmp_path: Path) -> None:
    path = _two_sequences(tmp_path, ["batch_size", "s1", "heads"], ["batch_size", "s2", "heads"])
    hints = hints_with_inputs(ShardTensor("a", 1))
    expected = {"batch_size": 1, "s1": 8, "heads": 2, "s2": 2}
    assert resolve_dims(load_index(path), hints, 8, {}) == expected


def test_an_ambiguous_sequence_dim_asks_for_dim(tmp_path: Path) -> None:
    path = _two_sequences(tmp_path, ["batch", "s1", 4], ["batch", "s2", 4])
    hints = hints_with_inputs(ShardTensor("ab", 1))  # the Concat has no named dim there
    with pytest.raises(InputError) as error:
        resolve_dims(load_index(path), hints, 8, {})
    assert str(error.value).endswith(
        "cannot tell which dim is the sequence: the hinted sequence axes carry no dim name and "
        "the inputs have several (s1, s2); pass --dim s1=LENGTH for each"
    )
    assert resolve_dims(load_index(path), hints, 8, {"s1": 4, "s2": 4})["s1"] == 4


def _two_sequences(directory: Path, first: list, second: list) -> Path:
    node = helper.make_node("Concat", ["a", "b"], ["ab"], name="concat", axis=1)
    graph = helper.make_graph(
        [node],
        "two_sequences",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, first),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, second),
        ],
        [helper.make_tensor_value_info("ab", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = directory / "two.onnx"
    onnx.save(model, path)
    return path


def test_feeds_have_the_declared_types_and_shapes_and_are_seeded() -> None:
    index = load_index(REAL / "ts_bert_tiny.onnx")
    feeds = make_feeds(index, {"batch": 2, "sequence": 8}, seed=3)
    assert {name: (v.dtype, v.shape) for name, v in feeds.items()} == {
        "input_ids": (np.dtype(np.int64), (2, 8)),
        "attention_mask": (np.dtype(np.int64), (2, 8)),
    }
    again = make_feeds(index, {"batch": 2, "sequence": 8}, seed=3)
    other = make_feeds(index, {"batch": 2, "sequence": 8}, seed=4)
    assert np.array_equal(feeds["input_ids"], again["input_ids"])
    assert not np.array_equal(feeds["input_ids"], other["input_ids"])


@pytest.mark.parametrize("name", ["ts_bert_tiny", "ts_gpt2_tiny", "dynamo_llama_tiny_gqa"])
def test_token_ids_stay_inside_the_embedding_and_masks_are_ones_at_batch_1(name: str) -> None:
    index = load_index(REAL / f"{name}.onnx")
    size = embedding_table_size(index, "input_ids")
    assert size is not None and size > 2
    feeds = make_feeds(index, {"batch": 4, "sequence": 64}, seed=0)
    assert 0 <= feeds["input_ids"].min() and feeds["input_ids"].max() < size
    assert len(np.unique(feeds["input_ids"])) > 2
    assert np.all(make_feeds(index, {"batch": 1, "sequence": 64}, seed=0)["attention_mask"] == 1)


@pytest.mark.parametrize(
    ("length", "padded"),
    # An odd count of about a third of the row: 8 // 3 = 2 -> 3; 16 // 3 = 5; 64 // 3 = 21.
    [(1, 0), (2, 1), (3, 1), (8, 3), (16, 5), (64, 21)],
)
def test_a_padded_row_ends_in_an_odd_third_of_zeros(length: int, padded: int) -> None:
    assert padded_positions(length) == padded


def test_at_batch_2_the_padding_mask_pads_odd_rows_at_lengths_no_ranks_divide() -> None:
    index = load_index(REAL / "ts_bert_tiny.onnx")
    mask = make_feeds(index, {"batch": 3, "sequence": 8}, seed=0)["attention_mask"]
    tokens = [1] * 5 + [0] * 3  # 3 padded, 5 tokens: neither divides by 2 or 4 ranks
    assert mask.tolist() == [[1] * 8, tokens, [1] * 8]
    assert (
        make_feeds(index, {"batch": 2, "sequence": 16}, seed=0)["attention_mask"][1].tolist()
        == [1] * 11 + [0] * 5
    )


def test_position_ids_count_as_a_tokenizer_gives_them(tmp_path: Path) -> None:
    path = tmp_path / "positions.onnx"
    batch_seq = ["batch", "sequence"]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "position_ids"], ["y"], name="embed")],
        "positions",
        [helper.make_tensor_value_info("position_ids", TensorProto.INT64, batch_seq)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*batch_seq, 4])],
        [helper.make_tensor("table", TensorProto.FLOAT, [32, 4], [0.0] * 128)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    feeds = make_feeds(load_index(path), {"batch": 2, "sequence": 6}, seed=0)
    assert feeds["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    assert feeds["position_ids"].dtype == np.int64


def test_float_inputs_are_random_and_a_missing_dim_is_named() -> None:
    index = load_index(FIXTURES / "attention_head.onnx")
    feeds = make_feeds(index, {"batch": 1, "sequence_len": 4}, seed=0)
    assert feeds["input"].dtype == np.float32 and feeds["input"].shape == (1, 4, 16)
    assert feeds["input"].std() > 0.5
    with pytest.raises(InputError) as error:
        make_feeds(index, {"batch": 1}, seed=0)
    assert str(error.value).endswith(
        "input 'input': no value for dim 'sequence_len'; pass --dim sequence_len=VALUE"
    )


def test_an_input_without_shape_cannot_be_fed() -> None:
    index = load_index(FIXTURES / "attention_same_qkv.onnx")
    with pytest.raises(InputError, match="input 'q' declares no shape"):
        make_feeds(index, {}, seed=0)


def test_run_model_runs_on_the_cpu() -> None:
    index = load_index(FIXTURES / "attention_head.onnx")
    dims = resolve_dims(index, read_hints(GOLDEN / "attention_head.json"), 6, {})
    feeds = make_feeds(index, dims, seed=0)
    outputs = run_model(index.model, feeds)
    assert list(outputs) == ["output"]
    assert outputs["output"].shape == (1, 6, 16)


def test_sessions_run_the_graph_as_written_on_one_thread_without_an_arena() -> None:
    import onnxruntime

    session = make_session((REAL / "ts_gpt2_tiny.onnx").read_bytes())
    options = session.get_session_options()
    assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)
    assert options.execution_mode == onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    assert not options.enable_cpu_mem_arena


def test_without_graph_optimizations_the_outputs_are_onnxruntimes_usual_ones() -> None:
    import onnxruntime

    model = (REAL / "ts_gpt2_tiny.onnx").read_bytes()
    index = load_index(REAL / "ts_gpt2_tiny.onnx")
    dims = resolve_dims(index, hints_with_inputs(ShardTensor("input_ids", 1)), 16, {})
    feeds = make_feeds(index, dims, seed=0)
    optimized = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    expected = optimized.run(None, feeds)
    observed = make_session(model).run(None, feeds)
    assert len(observed) == len(expected)
    for ours, theirs in zip(observed, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


ONNXRUNTIME_ERROR = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape node.\n"
    "Name:'reshape' Status Message: /src/cpu/tensor/reshape_helper.h:45 "
    "onnxruntime::ReshapeHelper::ReshapeHelper(const TensorShape&, bool) The input tensor "
    "cannot be reshaped to the requested shape\n"
)


def test_an_onnxruntime_error_is_read_for_its_node_and_its_status() -> None:
    assert failed_node(ONNXRUNTIME_ERROR) == "reshape"
    assert failed_node("Name:'' Status Message: x") == ""  # an unnamed node
    assert failed_node("no node named") is None
    assert error_text(ONNXRUNTIME_ERROR, status_only=True) == (
        "The input tensor cannot be reshaped to the requested shape"
    )
    whole = error_text(ONNXRUNTIME_ERROR)
    assert "\n" not in whole and whole.startswith("[ONNXRuntimeError] : 1 : FAIL")
    short = error_text(ONNXRUNTIME_ERROR, limit=40)
    assert len(short) == 40 and short == whole[:37] + "..."
