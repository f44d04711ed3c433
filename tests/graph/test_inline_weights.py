"""Inline weights in one copy (graph/inline_weights.py): a model file's large inline weights
are left in its one read-only mapping, the parsed model marks them external data of the file
itself, and every reader (onnxruntime's sessions, the simulation, a causal mask's check,
shard's output) reads them from there; results are those of the whole parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, GOLDEN, ROOT, benchmark_models, run_cli, run_script
from onnx import helper, numpy_helper

from shardcheck.analysis.detect import detect_attention
from shardcheck.errors import InputError
from shardcheck.graph import inline_weights
from shardcheck.graph.loader import load_index, parse_model, weights_dir
from shardcheck.graph.mapped_files import mapped
from shardcheck.runtime.sessions import make_session

FLOAT = onnx.TensorProto.FLOAT
# Above every weight: the model is parsed whole, inline weights in it, as before lending.
NEVER = 1 << 62


def _inline_model(directory: Path) -> tuple[Path, np.ndarray]:
    """x [2, 512] @ W [512, 512] + b: W is 1 MiB inline (lent), b is small (left inline)."""
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((512, 512)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="matmul"),
            helper.make_node("Add", ["h", "b"], ["y"], name="add"),
        ],
        "inline",
        [helper.make_tensor_value_info("x", FLOAT, [2, 512])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 512])],
        [
            numpy_helper.from_array(weight, "W"),
            numpy_helper.from_array(np.ones(512, np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = directory / "inline.onnx"
    onnx.save(model, path)
    return path, weight


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The benchmark's one-layer encoder at hidden 512 (its eight weights are 1-2 MiB each,
    11 MB inline), and its hints from gen."""
    builder = benchmark_models()
    directory = tmp_path_factory.mktemp("encoder")
    model, hints = directory / "encoder.onnx", directory / "encoder.json"
    config = builder.EncoderConfig(depth=1, kind="export", hidden=512, heads=8, ffn=1024)
    onnx.save(builder.build_encoder(config), model)
    assert run_cli("gen", model, "-o", hints, "-q").exit_code == 0
    return model, hints


def test_a_large_inline_weight_is_left_where_it_lies_in_the_model_file(tmp_path: Path) -> None:
    path, weight = _inline_model(tmp_path)
    parsed = parse_model(path)
    tensors = {t.name: t for t in parsed.model.graph.initializer}
    assert tensors["W"].data_location == onnx.TensorProto.EXTERNAL
    assert not tensors["W"].HasField("raw_data")
    entries = {e.key: e.value for e in tensors["W"].external_data}
    # Where the weight's bytes are in the file, found without the wire format.
    assert entries == {
        "location": path.name,
        "offset": str(path.read_bytes().find(weight.tobytes())),
        "length": str(weight.nbytes),
    }
    # b is under INLINE_SHARED_BYTES: it stays in the parsed model.
    assert tensors["b"].HasField("raw_data") and not tensors["b"].external_data
    assert parsed.lent_weights is not None and set(parsed.lent_weights.spans) == {"W"}
    assert len(parsed.model.SerializeToString()) < weight.nbytes // 100
    parsed.check()  # onnx.checker passes on it (and never looks for the "external" file)


def test_a_session_is_lent_the_inline_weight_from_the_files_mapping(tmp_path: Path) -> None:
    """onnxruntime is given W as a view of the model file's mapping (add_initializer), and
    computes x @ W + b with it."""
    path, weight = _inline_model(tmp_path)
    index = load_index(path)
    assert index.lent_weights is not None
    session = make_session(index.model, weights_dir(path))
    assert set(session.shardcheck_weights) == {"W"}
    # The file's one mapping, which the session's weights keep alive.
    start = np.frombuffer(mapped(path.resolve(), 0, "W", str(path)), np.uint8).ctypes.data
    offset = session.shardcheck_weights["W"].data_ptr() - start
    assert offset == path.read_bytes().find(weight.tobytes())
    x = np.random.default_rng(8).standard_normal((2, 512)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    # Not prepacked (the lent weight cannot be freed), so rounded unlike a prepacked run.
    np.testing.assert_allclose(got, x @ weight + 1.0, rtol=1e-5, atol=1e-4)


def _json_of(monkeypatch: pytest.MonkeyPatch, threshold: int, *args: str | Path) -> object:
    monkeypatch.setattr(inline_weights, "INLINE_SHARED_BYTES", threshold)
    result = run_cli(*args, "--format", "json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    "command", [["verify", "--ranks", "2"], ["simulate", "--ranks", "2", "--seq-len", "8"]]
)
def test_verify_and_simulate_find_what_they_find_on_the_whole_model(
    monkeypatch: pytest.MonkeyPatch, encoder: tuple[Path, Path], command: list[str]
) -> None:
    model, hints = encoder
    lent = load_index(model).lent_weights
    assert lent is not None and len(lent.spans) == 8  # its two embeddings and six matrices
    name, *options = command
    whole = _json_of(monkeypatch, NEVER, name, model, hints, *options)
    assert (
        _json_of(monkeypatch, inline_weights.INLINE_SHARED_BYTES, name, model, hints, *options)
        == whole
    )


def test_gen_writes_the_hints_it_writes_of_the_whole_model(
    monkeypatch: pytest.MonkeyPatch, encoder: tuple[Path, Path], tmp_path: Path
) -> None:
    model, _ = encoder
    written = []
    for threshold in (NEVER, 1 << 20):
        monkeypatch.setattr(inline_weights, "INLINE_SHARED_BYTES", threshold)
        hints = tmp_path / f"{threshold}.json"
        assert run_cli("gen", model, "-o", hints, "-q").exit_code == 0
        written.append(hints.read_bytes())
    assert written[0] == written[1]


def _shard(
    monkeypatch: pytest.MonkeyPatch, threshold: int, model: Path, hints: Path, out: Path
) -> bytes:
    monkeypatch.setattr(inline_weights, "INLINE_SHARED_BYTES", threshold)
    result = run_cli("shard", model, hints, "-o", out)
    assert result.exit_code == 0, result.stderr
    return out.read_bytes()


def test_shard_writes_the_model_the_whole_parse_writes(
    monkeypatch: pytest.MonkeyPatch, encoder: tuple[Path, Path], tmp_path: Path
) -> None:
    """The lent weights go back inside the multi-device model, byte for byte."""
    model, hints = encoder
    whole = _shard(monkeypatch, NEVER, model, hints, tmp_path / "whole.onnx")
    lent = _shard(monkeypatch, 1 << 20, model, hints, tmp_path / "lent.onnx")
    assert lent == whole
    written = onnx.load(tmp_path / "lent.onnx", load_external_data=False)
    assert not any(t.external_data for t in written.graph.initializer)


@pytest.mark.parametrize(
    "name",
    [
        "attention_head",
        "real/ts_gpt2_tiny",
        "real/dynamo_llama_tiny_gqa",
        "real/dynamo_mixtral_moe_tiny",
    ],
)
def test_shard_writes_the_same_bytes_with_every_weight_lent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    """The fixtures' weights are all below 1 MiB: lent from 16 bytes on, each initializer of
    raw data goes through the mapping and back."""
    model, hints = FIXTURES / f"{name}.onnx", GOLDEN / f"{name}.json"
    whole = _shard(monkeypatch, NEVER, model, hints, tmp_path / "whole.onnx")
    assert _shard(monkeypatch, 16, model, hints, tmp_path / "lent.onnx") == whole


def _causal_model(directory: Path) -> Path:
    """One attention whose scores are masked by Where with a slice of ``bias``, a lower
    triangular bool [1024, 1024] initializer (1 MiB: lent), as GPT-2's TorchScript export has it."""
    shape = ["batch", "seq", 16]
    nodes = [
        helper.make_node("Transpose", ["k"], ["k_T"], name="transpose_k", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "k_T"], ["scores"], name="scores"),
        helper.make_node("Shape", ["scores"], ["ends"], name="ends", start=1, end=3),
        helper.make_node("Slice", ["bias", "starts", "ends"], ["mask"], name="mask"),
        helper.make_node("Where", ["mask", "scores", "fill"], ["masked"], name="where"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["out"], name="context"),
    ]
    graph = helper.make_graph(
        nodes,
        "causal",
        [helper.make_tensor_value_info(x, FLOAT, shape) for x in "qkv"],
        [helper.make_tensor_value_info("out", FLOAT, shape)],
        [
            numpy_helper.from_array(np.tril(np.ones((1024, 1024), np.bool_)), "bias"),
            numpy_helper.from_array(np.zeros(2, np.int64), "starts"),
            numpy_helper.from_array(np.array(-1e4, np.float32), "fill"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = directory / "causal.onnx"
    onnx.save(model, path)
    return path


def test_a_causal_mask_left_in_the_file_is_read_from_there(tmp_path: Path) -> None:
    index = load_index(_causal_model(tmp_path))
    assert index.lent_weights is not None and set(index.lent_weights.spans) == {"bias"}
    (layer,) = detect_attention(index)
    assert layer.causal == "constant triangular mask bias"


def test_weights_that_cannot_be_lent_stay_inline(tmp_path: Path) -> None:
    """A type numpy has no dtype of (bfloat16), or raw data that is not its dims' size: the
    parsed model has them as the file does."""
    bfloat = onnx.TensorProto(
        name="bf", data_type=onnx.TensorProto.BFLOAT16, dims=[1 << 19], raw_data=bytes(1 << 20)
    )
    short = onnx.TensorProto(name="short", data_type=FLOAT, dims=[1 << 19], raw_data=bytes(1 << 20))
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "kept",
        [helper.make_tensor_value_info("x", FLOAT, [1])],
        [helper.make_tensor_value_info("y", FLOAT, [1])],
        [bfloat, short],
    )
    path = tmp_path / "kept.onnx"
    onnx.save(helper.make_model(graph, ir_version=8), path)
    parsed = parse_model(path)
    assert parsed.lent_weights is None
    for tensor in parsed.model.graph.initializer:
        assert tensor.raw_data == bytes(1 << 20) and not tensor.external_data
        assert not tensor.HasField("data_location")


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bad_wire_type(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] = data[0] | 7  # the first field's tag: wire type 7 does not exist
    path.write_bytes(bytes(data))


def _weight_runs_past_the_end(path: Path) -> None:
    """The last bytes of the weight cut, its length unchanged: the graph runs past the file."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 2048])


@pytest.mark.parametrize("damage", [_cut, _bad_wire_type, _weight_runs_past_the_end])
@pytest.mark.parametrize("command", ["gen", "verify"])
def test_a_damaged_model_with_inline_weights_is_one_error_line(
    tmp_path: Path, damage: object, command: str
) -> None:
    path, _ = _inline_model(tmp_path)
    damage(path)  # type: ignore[operator]
    hints = tmp_path / "hints.json"
    args = ["-o", hints] if command == "gen" else [GOLDEN / "attention_head.json"]
    result = run_cli(command, path, *args)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"shardcheck: error: {path}: "), lines
    assert "not a readable ONNX model" in lines[0] or "not an ONNX model" in lines[0], lines[0]


# The model file is cut to half its size, or grown, right after shardcheck has parsed it and
# checked its weight files, before the sessions read its weights: what a model rewritten in
# place while shardcheck runs does.
_CHANGE_AFTER_THE_CHECK = """
import sys
from pathlib import Path
import shardcheck.graph.loader as loader
real_check = loader.check_weight_files
def check_then_change(index, path):
    real_check(index, path)
    size = Path(path).stat().st_size
    with open(path, "r+b") as file:
        if {shrink}:
            file.truncate(size // 2)
        else:
            file.seek(0, 2)
            file.write(bytes(4096))
loader.check_weight_files = check_then_change
from shardcheck.cli import main
sys.argv = ["shardcheck", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("shrink", [True, False])
@pytest.mark.parametrize(
    "command", [["verify", "--ranks", "2"], ["simulate", "--ranks", "2", "--seq-len", "8"]]
)
def test_a_model_file_that_changes_size_while_mapped_is_one_error_line(
    encoder: tuple[Path, Path], tmp_path: Path, command: list[str], shrink: bool
) -> None:
    """Not SIGBUS (exit -7, nothing said), nor weights read at offsets the file no longer
    has: the model file is refused once it differs from what was parsed."""
    model, hints = encoder
    path = tmp_path / "model.onnx"
    path.write_bytes(model.read_bytes())
    script = textwrap.dedent(_CHANGE_AFTER_THE_CHECK.format(shrink=shrink))
    name, *options = command
    done = run_script(script, name, path, hints, *options)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"shardcheck: error: {path}: "), lines
    assert f"the model file {path.name!r} changed while shardcheck ran" in lines[0], lines[0]


def test_a_changed_model_file_is_refused_where_a_weight_is_read(tmp_path: Path) -> None:
    path, _ = _inline_model(tmp_path)
    index = load_index(path)
    assert index.lent_weights is not None
    with open(path, "ab") as file:
        file.write(b"\0")
    with pytest.raises(InputError, match="changed while shardcheck ran"):
        index.lent_weights.data("W", str(path))
    with pytest.raises(InputError, match="changed while shardcheck ran"):
        make_session(index.model, weights_dir(path), source=str(path))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_model_fed_through_a_named_pipe_is_read_whole(tmp_path: Path) -> None:
    """A named pipe is not walked (opened and closed unread, it would end its writer): it is
    read to its end, as before, and gen writes the hints of the file it was fed."""
    path, _ = _inline_model(tmp_path)
    expected = tmp_path / "expected.json"
    assert run_cli("gen", path, "-o", expected, "-q").exit_code == 0
    fifo = tmp_path / "fed.onnx"
    os.mkfifo(fifo)
    script = 'cat "$1" > "$2" & exec "$3" -m shardcheck gen "$2" -o - -q'
    done = subprocess.run(
        ["bash", "-c", script, "_", str(path), str(fifo), sys.executable],
        capture_output=True,
        text=True,
        timeout=120,  # a gen waiting for a writer that is gone would hang
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(expected.read_text())
