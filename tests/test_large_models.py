"""Models over 2 GiB, whose weights live in external files: gen, verify with the simulation and
shard work on them, and the weights are never copied into memory (onnxruntime reads them from
their file). A serialized ModelProto cannot exceed 2 GiB, so a model that size only exists with
external data.

The weight file is sparse: 2.2 GiB long, a few kilobytes on disk. Its big tensor is an
embedding table read by a Gather, so a run touches only the rows it looks up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import attention_nodes, run_cli
from onnx import TensorProto, helper

from shardcheck import read_hints
from shardcheck.hints.codec import dumps
from shardcheck.hints.model import AttentionLayerHint, ShardHints, ShardTensor

GIB = 1 << 30
ROWS = 150_000_000  # x 4 float32 = 2.24 GiB
WEIGHTS = "weights.bin"


def _external(name: str, dims: list[int], offset: int, length: int) -> onnx.TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", WEIGHTS), ("offset", offset), ("length", length)):
        tensor.external_data.add(key=key, value=str(value))
    return tensor


def build_large_model(directory: Path) -> Path:
    """ids [seq], x0 [seq, 4] -> table[ids] + x0 -> one attention layer (K transposed) -> y."""
    rng = np.random.default_rng(0)
    initializers = []
    with (directory / WEIGHTS).open("wb") as weights:
        for name in ("W_q", "W_k", "W_v"):
            data = rng.standard_normal((4, 4)).astype(np.float32).tobytes()
            initializers.append(_external(name, [4, 4], weights.tell(), len(data)))
            weights.write(data)
        table_offset = -(-weights.tell() // 4096) * 4096
        initializers.append(_external("table", [ROWS, 4], table_offset, ROWS * 16))
        weights.truncate(table_offset + ROWS * 16)  # zeros, without writing them
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embed"),
        helper.make_node("Add", ["embedded", "x0"], ["x"], name="add"),
        *attention_nodes(),
    ]
    graph = helper.make_graph(
        nodes,
        "large",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["seq"]),
            helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["seq", 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 4])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = directory / "large.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture(scope="module")
def large_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_large_model(tmp_path_factory.mktemp("large"))
    weights = path.parent / WEIGHTS
    if weights.stat().st_blocks * 512 > GIB:
        pytest.skip(f"{weights.parent}: this file system does not keep files sparse")
    assert weights.stat().st_size > 2 * GIB
    return path


# What gen must find: the sequence runs along axis 0 of both inputs and of the output, and
# along axis 1 of the transposed K ([4, seq]), axis 0 of V ([seq, 4]).
EXPECTED = ShardHints(
    attention_layers=(AttentionLayerHint(q="q", gather_kv=True, gather_q=False),),
    inputs=(ShardTensor("ids", 0, 1), ShardTensor("x0", 0, 2)),
    outputs=(ShardTensor("y", 0, 2),),
    k_seq_len_idx=1,
    v_seq_len_idx=0,
)


def test_gen_finds_the_hints_of_a_model_over_2_gib(large_model: Path, tmp_path: Path) -> None:
    hints = tmp_path / "hints.json"
    result = run_cli("gen", large_model, "-o", hints)
    assert result.exit_code == 0, result.stderr
    found = read_hints(hints)
    assert found.attention_layers == EXPECTED.attention_layers
    assert sorted(found.inputs, key=str) == sorted(EXPECTED.inputs, key=str)
    assert (found.outputs, found.k_seq_len_idx, found.v_seq_len_idx) == (
        EXPECTED.outputs,
        EXPECTED.k_seq_len_idx,
        EXPECTED.v_seq_len_idx,
    )


def _verify_in_a_child(model: Path, hints: Path) -> dict[str, object]:
    """verify --ranks 2 in a fresh process: its report and its peak resident memory."""
    script = (
        "import json, resource, sys\n"
        "from shardcheck import verify\n"
        "report = verify(sys.argv[1], sys.argv[2], ranks=2)\n"
        "print(json.dumps({'ok': report.ok, 'codes': sorted({f.code for f in report.errors}),"
        " 'peak_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(model), str(hints)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_verify_runs_a_model_over_2_gib_without_copying_its_weights(
    large_model: Path, tmp_path: Path
) -> None:
    hints = tmp_path / "hints.json"
    hints.write_text(dumps(EXPECTED))
    result = _verify_in_a_child(large_model, hints)
    assert result["ok"], result
    # A copy of the weights alone would be 2.2 GiB.
    assert result["peak_kib"] < GIB // 1024 // 2, result

    wrong = tmp_path / "wrong.json"
    wrong.write_text(dumps(EXPECTED.with_changes(k_seq_len_idx=0)))
    result = _verify_in_a_child(large_model, wrong)
    assert not result["ok"] and "SC105" in result["codes"], result


def test_shard_writes_a_model_over_2_gib_that_shares_its_weight_file(
    large_model: Path, tmp_path: Path
) -> None:
    hints = tmp_path / "hints.json"
    hints.write_text(dumps(EXPECTED))
    output = large_model.parent / "sharded.onnx"
    result = run_cli("shard", large_model, hints, "-o", output)
    assert result.exit_code == 0, result.stderr
    sharded = onnx.load(str(output), load_external_data=False)
    table = next(t for t in sharded.graph.initializer if t.name == "table")
    assert {e.key: e.value for e in table.external_data}["location"] == WEIGHTS
    assert output.stat().st_size < 1 << 20
