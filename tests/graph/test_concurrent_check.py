"""gen runs onnx.checker in a forked child while it analyses: same verdicts, same messages."""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
from conftest import FIXTURES, run_cli

from shardcheck.errors import ModelError
from shardcheck.graph import concurrent_check, loader, protos
from shardcheck.graph.concurrent_check import checked_concurrently
from shardcheck.graph.loader import index_parsed, load_index, parse_model

MODEL = FIXTURES / "attention_head.onnx"
FORK_BESIDE_THREADS = "ignore:This process .* is multi-threaded, use of fork"


@pytest.fixture(autouse=True)
def as_in_the_cli(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The console command forks from a process with no other thread (tested below, in a child
    process); this one has numpy's and onnxruntime's. These tests fork from it all the same."""
    if "real_thread_count" not in request.keywords:
        monkeypatch.setattr(concurrent_check, "_single_threaded", lambda: True)


pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform"),
    pytest.mark.filterwarnings(FORK_BESIDE_THREADS),
]


def _invalid_model(directory: Path) -> Path:
    model = onnx.load(MODEL)
    model.graph.node[0].op_type = "NoSuchOp"
    path = directory / "invalid.onnx"
    onnx.save(model, path)
    return path


def _checker_recording_pids(
    monkeypatch: pytest.MonkeyPatch, record: Path, then: Callable[[], None] | None = None
) -> None:
    """Wrap onnx's checker (the function onnx.checker.check_model calls) so that each call
    appends the calling process's pid to a file (a forked child inherits the wrapper)."""
    checker = protos.checker()
    real = checker.check_model

    def recording(model: Any, *args: Any, **kwargs: Any) -> None:
        with record.open("a") as file:
            file.write(f"{os.getpid()}\n")
        if then is not None:
            then()
        real(model, *args, **kwargs)

    monkeypatch.setattr(checker, "check_model", recording)


def _pids(record: Path) -> list[int]:
    return [int(line) for line in record.read_text().split()] if record.exists() else []


def test_the_checker_runs_in_a_child_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "pids"
    _checker_recording_pids(monkeypatch, record)
    result = run_cli("gen", MODEL, "-o", tmp_path / "hints.json")
    assert result.exit_code == 0, result.stderr
    pids = _pids(record)
    assert len(pids) == 1 and pids[0] != os.getpid()
    assert (tmp_path / "hints.json").exists()


def test_a_model_the_checker_refuses_gets_the_checkers_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    invalid = _invalid_model(tmp_path)
    with pytest.raises(ModelError) as expected:
        load_index(invalid)
    record = tmp_path / "pids"
    _checker_recording_pids(monkeypatch, record)
    result = run_cli("gen", invalid, "-o", tmp_path / "hints.json")
    assert result.exit_code == 2
    assert result.stderr == f"shardcheck: error: {expected.value.message}\n"
    assert "fails onnx.checker" in result.stderr
    assert [pid != os.getpid() for pid in _pids(record)] == [True]
    assert not (tmp_path / "hints.json").exists()


def test_the_checkers_verdict_comes_before_an_analysis_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_analysis(*_args: Any) -> Any:
        raise RuntimeError("the analysis broke on this graph")

    monkeypatch.setattr("shardcheck.cli.gen.generate", broken_analysis)
    result = run_cli("gen", _invalid_model(tmp_path), "-o", tmp_path / "hints.json")
    assert result.exit_code == 2
    assert "fails onnx.checker" in result.stderr
    # On a model the checker accepts, the analysis's own error is not hidden.
    valid = run_cli("gen", MODEL, "-o", tmp_path / "hints.json")
    assert "internal error: RuntimeError: the analysis broke on this graph" in valid.stderr


def test_without_fork_the_check_runs_first_in_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(concurrent_check, "_can_fork", lambda: False)
    record = tmp_path / "pids"
    _checker_recording_pids(monkeypatch, record)
    assert run_cli("gen", MODEL, "-o", tmp_path / "hints.json").exit_code == 0
    invalid = run_cli("gen", _invalid_model(tmp_path), "-o", tmp_path / "other.json")
    assert invalid.exit_code == 2 and "fails onnx.checker" in invalid.stderr
    assert _pids(record) == [os.getpid(), os.getpid()]


@pytest.mark.parametrize("valid", [True, False])
def test_a_child_that_dies_is_replaced_by_a_check_in_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, valid: bool
) -> None:
    parent = os.getpid()

    def die_in_the_child() -> None:
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    record = tmp_path / "pids"
    _checker_recording_pids(monkeypatch, record, then=die_in_the_child)
    model = MODEL if valid else _invalid_model(tmp_path)
    result = run_cli("gen", model, "-o", tmp_path / "hints.json")
    assert result.exit_code == (0 if valid else 2), result.stderr
    assert (tmp_path / "hints.json").exists() == valid
    pids = _pids(record)
    assert len(pids) == 2 and pids[0] != parent and pids[1] == parent


def _with_external_constant(directory: Path, location: str) -> Path:
    """MODEL with one more node: a Constant whose value is in the external file ``location``
    (nothing reads it; only the walk over the nodes finds it, no initializer is external)."""
    model = onnx.load(MODEL)
    value = onnx.helper.make_tensor("table", onnx.TensorProto.FLOAT, [4], [0.0] * 4)
    value.ClearField("float_data")
    value.data_location = onnx.TensorProto.EXTERNAL
    value.external_data.add(key="location", value=location)
    model.graph.node.append(onnx.helper.make_node("Constant", [], ["unused"], value=value))
    path = directory / "external_constant.onnx"
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("fork", [True, False])
def test_gen_refuses_to_write_over_the_weight_file_of_a_constant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork: bool
) -> None:
    if not fork:
        monkeypatch.setattr(concurrent_check, "_can_fork", lambda: False)
    weights = tmp_path / "table.bin"
    weights.write_bytes(bytes(16))
    model = _with_external_constant(tmp_path, "table.bin")
    result = run_cli("gen", model, "-o", weights)
    assert result.exit_code == 2
    assert result.stderr == (
        f"shardcheck: error: {weights}: is a weight file of the model; write the hints elsewhere\n"
    )
    assert weights.read_bytes() == bytes(16)
    assert run_cli("gen", model, "-o", tmp_path / "hints.json").exit_code == 0


def test_gen_refuses_a_constant_whose_weights_are_outside_the_models_directory(
    tmp_path: Path,
) -> None:
    model = _with_external_constant(tmp_path, "../table.bin")
    result = run_cli("gen", model, "-o", tmp_path / "hints.json")
    assert result.exit_code == 2
    assert result.stderr == (
        f"shardcheck: error: {model}: tensor in a node attribute 'table': external data location "
        "'../table.bin' is outside the model's directory; refused\n"
    )
    assert not (tmp_path / "hints.json").exists()


def test_the_child_walks_the_nodes_and_the_parent_takes_what_it_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = os.getpid()
    walks: list[int] = []  # this process's walks over the nodes (the child's are its own)
    real = loader._scan_nodes

    def counted(model: Any) -> Any:
        if os.getpid() == parent:
            walks.append(parent)
        return real(model)

    monkeypatch.setattr(loader, "_scan_nodes", counted)
    parsed = parse_model(_with_external_constant(tmp_path, "table.bin"))
    assert parsed.initializer_locations() == set()
    with checked_concurrently(parsed):
        pass
    assert parsed.external_locations() == {"table.bin"}
    assert walks == []
    # Without the child's answer, the parent walks the nodes itself, once, and finds the same.
    parsed = parse_model(_with_external_constant(tmp_path, "table.bin"))
    assert parsed.serialized is None  # not all of the model is in the file
    assert [t.name for t in index_parsed(parsed).external_tensors()] == ["table"]
    assert parsed.external_locations() == {"table.bin"}
    assert walks == [parent]


def test_verifys_read_skips_the_walk_over_the_attributes_when_nothing_can_be_external(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[str] = []
    real = loader._scan_nodes

    def counted(model: Any) -> Any:
        walks.append(model.graph.name)
        return real(model)

    monkeypatch.setattr(loader, "_scan_nodes", counted)
    # The file never spells "location": no tensor of it can be external.
    assert b"location" not in MODEL.read_bytes()
    parsed = parse_model(MODEL)
    assert parsed.serialized == MODEL.read_bytes()
    assert parsed.external_tensors() == []
    assert walks == []
    parsed.check()  # the check reads the node names only
    assert walks == []
    # Duplicate names are still refused so.
    model = onnx.load(MODEL)
    model.graph.node[1].name = model.graph.node[0].name = "same"
    onnx.save(model, tmp_path / "duplicates.onnx")
    with pytest.raises(ModelError, match="duplicate node names 'same'"):
        parse_model(tmp_path / "duplicates.onnx").check()
    assert walks == []
    # A Constant with external data spells it: the walk finds it before the bytes are handed.
    external = parse_model(_with_external_constant(tmp_path, "table.bin"))
    assert external.serialized is None
    assert [t.name for t in external.external_tensors()] == ["table"]
    assert len(walks) == 1


@pytest.fixture
def quiet_fault_handler() -> Iterator[None]:
    """A child process dies on purpose in the test: pytest's fault handler need not report it."""
    enabled = faulthandler.is_enabled()
    faulthandler.disable()
    yield
    if enabled:
        faulthandler.enable()


@pytest.mark.usefixtures("quiet_fault_handler")
def test_a_model_file_truncated_after_the_parse_is_still_checked(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(MODEL.read_bytes())
    parsed = parse_model(model)
    with checked_concurrently(parsed):
        # Rewritten in place (as onnx.save does) while gen analyses: whether or not the child
        # process still reads it, the check holds, made again here on the parsed model if need be.
        model.write_bytes(b"")
    assert parsed._checked
    invalid = _invalid_model(tmp_path)
    parsed = parse_model(invalid)
    with pytest.raises(ModelError, match=r"fails onnx\.checker"), checked_concurrently(parsed):
        invalid.write_bytes(b"")


# The console command, in a process of its own: the checker's pid, and the command's.
_RECORDING_GEN = """
import os, sys
from shardcheck.cli import main
from shardcheck.graph.loader import ParsedModel

record, model, out = sys.argv[1:4]
real = ParsedModel.check

def recording(self):
    with open(record, "a") as file:
        file.write(f"{os.getpid()}\\n")
    real(self)

ParsedModel.check = recording
with open(record, "a") as file:
    file.write(f"{os.getpid()}\\n")
sys.argv = ["shardcheck", "gen", model, "-o", out]
main()
"""


@pytest.mark.real_thread_count
def test_the_console_command_forks_the_checker(tmp_path: Path) -> None:
    """Nothing gen imports before the fork starts a thread (numpy and onnx, which do, are not
    imported yet): the real command checks in a child."""
    import subprocess
    import sys

    record = tmp_path / "pids"
    done = subprocess.run(
        [sys.executable, "-c", _RECORDING_GEN, str(record), str(MODEL), str(tmp_path / "h.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    command, checker = _pids(record)
    assert checker != command


@pytest.mark.real_thread_count
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads counted in /proc")
def test_no_fork_beside_a_native_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A native thread (here onnxruntime's pool, which Python's threading does not see) may hold
    a lock a forked child would wait for forever: the check then runs in the process."""
    import threading

    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    session = onnxruntime.InferenceSession(str(MODEL), options, providers=["CPUExecutionProvider"])
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) > 1
    record = tmp_path / "pids"
    _checker_recording_pids(monkeypatch, record)
    assert run_cli("gen", MODEL, "-o", tmp_path / "hints.json").exit_code == 0
    assert _pids(record) == [os.getpid()]
    del session
