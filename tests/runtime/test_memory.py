"""verify and the simulation are bounded: a memory estimate refuses runs that cannot fit, before
running, and ``--timeout`` cancels an onnxruntime run that takes too long."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, GOLDEN, run_cli
from onnx import TensorProto, helper

from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import InputError
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.loader import load_index
from shardcheck.hints.files import write_hints
from shardcheck.runtime.memory import (
    available_bytes,
    estimate,
    human,
    refuse_oversized_run,
    resolve,
)

MODEL = FIXTURES / "attention_head.onnx"  # x [batch, sequence_len, 16] -> scores [b, S, S]
HINTS = GOLDEN / "attention_head.json"
# No machine has 400 TB: the scores of one layer at this length, in float32.
HUGE_LENGTH = 10**7


def test_resolve_substitutes_dims_and_counts_unknown_sizes_as_one() -> None:
    dims = {"batch": 2, "seq": 8}
    assert resolve(("batch", "seq", 16), dims) == (2, 8, 16)
    assert resolve(("batch*seq", "2*seq", "other", None, -1), dims) == (16, 16, 1, 1, 1)


def test_estimate_counts_the_attention_scores() -> None:
    index = load_index(MODEL)
    small = estimate(index, {"batch": 1, "sequence_len": 8})
    large = estimate(index, {"batch": 1, "sequence_len": 4096})
    assert large.largest_shape == (1, 4096, 4096)
    assert large.largest_bytes == 4096 * 4096 * 4
    # the scores, their softmax (the largest intermediate twice), the weights and the I/O
    assert 2 * 4096 * 4096 * 4 < large.total < 3 * 4096 * 4096 * 4
    assert small.total < large.total


def test_estimate_counts_the_scores_inside_a_fused_attention_node() -> None:
    index = load_index(FIXTURES / "real" / "dynamo_sdpa_opset23.onnx")
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    assert {layer.kind for layer in layers} == {"fused"}
    found = estimate(index, {"batch": 1, "sequence": 4096}, shapes=shapes, layers=layers)
    assert found.largest.startswith("scores of ")
    assert found.largest_shape == (1, 2, 4096, 4096)


def test_estimate_sizes_each_tensor_by_its_own_element_type() -> None:
    """Three tensors of one shape, [batch, seq, 4]: the float16 input and output take 2 bytes an
    element, the float64 tensor between them 8 (it is the largest, counted twice)."""
    shape = ["batch", "seq", 4]
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["wide"], to=TensorProto.DOUBLE),
            helper.make_node("Cast", ["wide"], ["y"], to=TensorProto.FLOAT16),
        ],
        "casts",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, shape)],
        value_info=[helper.make_tensor_value_info("wide", TensorProto.DOUBLE, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    found = estimate(GraphIndex(model), {"batch": 1, "seq": 1000})
    narrow_bytes, wide_bytes = 1000 * 4 * 2, 1000 * 4 * 8
    assert (found.largest, found.largest_shape, found.largest_bytes) == (
        "wide",
        (1, 1000, 4),
        wide_bytes,
    )
    assert found.total == 2 * narrow_bytes + 2 * wide_bytes


def test_an_oversized_run_is_refused_with_the_length_the_dims_and_the_estimate() -> None:
    index = load_index(MODEL)
    dims = {"batch": 1, "sequence_len": 4096}
    needed = estimate(index, dims).total
    assert refuse_oversized_run(index, dims, seq_len=4096, available=needed).total == needed
    with pytest.raises(InputError) as refused:
        refuse_oversized_run(index, dims, seq_len=4096, available=needed - 1)
    message = refused.value.message
    assert message.startswith(f"{index.source}: sequence length 4096 ")
    assert "(dims batch=1, sequence_len=4096)" in message
    assert f"needs about {human(needed)} of memory" in message
    assert "largest tensor 'head_scores' [1, 4096, 4096]: 64.0 MiB" in message
    assert "refused before running" in message


def test_available_memory_is_known_on_linux() -> None:
    available = available_bytes()
    if available is None:
        pytest.skip("this system does not report its available memory")
    assert 0 < available < 2**60


def test_human_sizes() -> None:
    assert human(512) == "512 B"
    assert human(1536) == "1.5 KiB"
    assert human(64 * 2**20) == "64.0 MiB"
    assert human(10**30) == "1e+30 B"


def test_verify_refuses_a_length_that_cannot_fit_before_running() -> None:
    result = run_cli("verify", MODEL, HINTS, "--seq-lens", f"8,{HUGE_LENGTH}")
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert f"sequence length {HUGE_LENGTH} (dims batch=1, sequence_len={HUGE_LENGTH})" in line
    assert "head_scores" in line and "refused before running" in line
    assert result.stdout == ""  # no report: not even the length that fits was run


def test_verify_refuses_a_dim_that_cannot_fit() -> None:
    result = run_cli("verify", MODEL, HINTS, "--dim", f"batch={HUGE_LENGTH * 10**4}")
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert (
        f"batch={HUGE_LENGTH * 10**4}" in line
        and "choose a shorter --seq-lens or smaller --dim" in line
    )


def test_simulate_refuses_a_length_that_cannot_fit() -> None:
    result = run_cli("simulate", MODEL, HINTS, "--ranks", "2", "--seq-len", str(HUGE_LENGTH))
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert f"sequence length {HUGE_LENGTH}" in line and "--seq-len " in line


# ------------------------------------------------------------------ --timeout, for real


def slow_model(steps: int, width: int = 64) -> onnx.ModelProto:
    """``steps`` attention-like blocks on x [batch, seq, width]: softmax(y y^T) y, chained."""
    nodes = []
    y = "x"
    for i in range(steps):
        nodes += [
            helper.make_node("Transpose", [y], [f"t{i}"], perm=[0, 2, 1], name=f"transpose_{i}"),
            helper.make_node("MatMul", [y, f"t{i}"], [f"s{i}"], name=f"scores_{i}"),
            helper.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1, name=f"softmax_{i}"),
            helper.make_node("MatMul", [f"p{i}", y], [f"y{i}"], name=f"mix_{i}"),
        ]
        y = f"y{i}"
    nodes.append(helper.make_node("Identity", [y], ["out"], name="out"))
    shape = ["batch", "seq", width]
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_timeout_cancels_a_slow_onnxruntime_run(tmp_path: Path) -> None:
    model = tmp_path / "slow.onnx"
    onnx.save(slow_model(100), model)
    hints = tmp_path / "slow.json"
    write_hints(str(hints), generate(load_index(model), GenOptions()).hints)

    # 100 blocks at length 1024 take seconds (1024x1024 scores, twice, per block). The message
    # is given only when onnxruntime stopped because the timer set terminate (no timed
    # assertion: the machine's load decides how long it takes).
    result = run_cli("verify", model, hints, "--seq-lens", "1024,2048", "--timeout", "0.05")

    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"shardcheck: error: {model}: onnxruntime did not finish within --timeout 0.05 s "
        "(sequence length 1024); give it more time or use shorter --seq-lens"
    ]


def test_verify_refuses_weights_that_cannot_fit_before_onnxruntime_loads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shardcheck.runtime.memory as memory

    index = load_index(MODEL)
    weights = memory.weights_bytes(index)
    assert weights == 16 * 16 * 4 * 3  # three float32 [16, 16] projections
    monkeypatch.setattr(memory, "available_bytes", lambda: weights - 1)
    result = run_cli("verify", MODEL, HINTS)
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert f"{MODEL}: its weights need {human(weights)} of memory" in line
    assert "refused before loading them into onnxruntime" in line
