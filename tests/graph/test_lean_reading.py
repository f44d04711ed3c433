"""gen reads graphs without importing the onnx package or numpy, and without a copy of the file:
the shortcuts give exactly what the full readers give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURE_MODELS, FIXTURES
from onnx import helper as oh
from onnx import numpy_helper

from shardcheck.analysis.causal import (
    _is_triangular,
    _is_triangular_constant,
    _may_be_triangular_constant,
)
from shardcheck.analysis.tensor_info import raw_ints
from shardcheck.graph import protos
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.loader import _run_checker, load_index, parse_model
from shardcheck.graph.tensors import raw_values


def assert_prints_ok(code: str) -> None:
    """``code`` run by a fresh interpreter prints "ok" and nothing else."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["ok"], out.stderr[-2000:]


def test_gen_imports_neither_onnx_nor_numpy_on_any_fixture(tmp_path: Path) -> None:
    # One process for all models: each gen, as shipped (weighing the extension, counting the
    # plan's line on multi-device models built from the message classes), must leave both
    # unimported in the process itself (the checker's child process imports onnx; that is
    # its own). Only a model of local functions needs onnx: its inliner computes the calls.
    with_functions = [m for m in FIXTURE_MODELS if _has_functions(m)]
    assert len(with_functions) == 3  # the in_functions exports; a new one is listed here
    code = (
        "import sys; from shardcheck.cli import cli\n"
        f"for model in {[str(m) for m in FIXTURE_MODELS if m not in with_functions]!r}:\n"
        f"    cli.main(['gen', model, '-o', {str(tmp_path / 'h.json')!r}], "
        "standalone_mode=False)\n"
        "    assert 'onnx' not in sys.modules and 'numpy' not in sys.modules, model\n"
        "print('ok')\n"
    )
    assert_prints_ok(code)


def _has_functions(model: Path) -> bool:
    return bool(onnx.load(model, load_external_data=False).functions)


def test_the_onnx_package_imported_later_uses_the_same_classes() -> None:
    code = (
        "import sys; from shardcheck.graph import protos\n"
        "assert 'onnx' not in sys.modules\n"
        "onnx = protos.full_onnx()\n"
        "assert onnx.ModelProto is protos.ModelProto and onnx.TensorProto is protos.TensorProto\n"
        "assert onnx.onnx_ml_pb2.ModelProto is protos.ModelProto\n"
        "model = onnx.helper.make_model(onnx.helper.make_graph([], 'g', [], []))\n"
        "assert isinstance(model, protos.ModelProto)\n"
        "onnx.checker.check_model(model)\n"
        "print('ok')\n"
    )
    assert_prints_ok(code)


def test_the_checker_survives_a_restored_snapshot_of_sys_modules() -> None:
    # pytest's in-process runs (pytester) restore sys.modules afterwards, dropping the
    # extension loaded meanwhile; loading it again aborted the process (nanobind).
    code = (
        "import sys; from shardcheck.graph import protos\n"
        "snapshot = dict(sys.modules)\n"
        "first = protos.checker()\n"
        "sys.modules.clear(); sys.modules.update(snapshot)\n"
        "assert protos.full_onnx().checker.C is first\n"
        "assert protos.checker() is first\n"
        "print('ok')\n"
    )
    assert_prints_ok(code)


def test_checking_a_model_imports_neither_onnx_nor_numpy(tmp_path: Path) -> None:
    # onnx's checker is loaded alone (its compiled extension); the onnx package imported
    # afterwards finds it loaded, and its checker raises the same error class.
    invalid = onnx.load(FIXTURES / "attention_head.onnx")
    invalid.graph.node[0].op_type = "NoSuchOp"
    onnx.save(invalid, tmp_path / "invalid.onnx")
    code = (
        "import sys; from shardcheck.graph import protos\n"
        "from shardcheck.errors import ModelError\n"
        "from shardcheck.graph.loader import read_model\n"
        f"read_model({str(FIXTURE_MODELS[0])!r})\n"
        "try:\n"
        f"    read_model({str(tmp_path / 'invalid.onnx')!r})\n"
        "except ModelError as exc:\n"
        "    print(exc.message)\n"
        "assert 'onnx' not in sys.modules and 'numpy' not in sys.modules\n"
        "onnx = protos.full_onnx()\n"
        "assert onnx.onnx_cpp2py_export.checker is protos.checker()\n"
        "assert onnx.checker.ValidationError is protos.checker().ValidationError\n"
        "onnx.checker.check_model(onnx.load(sys.argv[1]))\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURE_MODELS[0])], capture_output=True, text=True
    )
    lines = out.stdout.splitlines()
    assert lines[-1:] == ["ok"], out.stderr[-2000:]
    with pytest.raises(onnx.checker.ValidationError) as by_onnx:
        onnx.checker.check_model(invalid)
    first_line = str(by_onnx.value).strip().splitlines()[0]
    assert lines[0] == f"{tmp_path / 'invalid.onnx'}: fails onnx.checker: {first_line}"


def _mutations() -> list[tuple[str, onnx.ModelProto]]:
    """Models onnx.checker refuses for different reasons, and one it accepts, by name."""
    base = onnx.load(FIXTURES / "attention_head.onnx")
    cases = []
    for name, mutate in (
        ("unknown op", lambda m: setattr(m.graph.node[0], "op_type", "NoSuchOp")),
        ("no graph name", lambda m: setattr(m.graph, "name", "")),
        ("unset input", lambda m: m.graph.node[-1].input.append("nowhere")),
        ("no opset", lambda m: m.ClearField("opset_import")),
        ("future IR", lambda m: setattr(m, "ir_version", 99)),
        ("valid", lambda m: None),
    ):
        model = onnx.ModelProto()
        model.CopyFrom(base)
        mutate(model)
        cases.append((name, model))
    return cases


@pytest.mark.parametrize("case", _mutations(), ids=lambda case: case[0])
def test_the_lean_checker_gives_onnx_checkers_verdicts(
    case: tuple[str, onnx.ModelProto],
) -> None:
    _, model = case
    try:
        onnx.checker.check_model(model)
        expected = None
    except onnx.checker.ValidationError as exc:
        expected = str(exc)
    try:
        _run_checker(model.SerializeToString())
        got = None
    except protos.checker().ValidationError as exc:
        got = str(exc)
    assert got == expected
    assert (expected is None) == (case[0] == "valid")


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda m: m.name)
def test_a_file_parses_to_what_onnx_load_reads(model: Path) -> None:
    parsed = parse_model(model)
    assert parsed.model == onnx.load(model)
    assert parsed.serialized == model.read_bytes()


def test_constants_read_without_numpy_agree_with_their_arrays() -> None:
    integers = 0
    for model in FIXTURE_MODELS:
        index = load_index(model)
        constants = [*index.initializers]
        constants += [node.outputs[0] for node in index.nodes if node.op_type == "Constant"]
        for name in constants:
            value = index.constant_value(name)
            where = f"{model.name}: {name}"
            assert index.constant_ndim(name) == (None if value is None else value.ndim), where
            ints = index.constant_ints(name)
            if value is None or value.dtype.kind not in "iu":
                assert ints is None, where
            else:
                assert ints == tuple(int(v) for v in value.reshape(-1)), where
                integers += 1
            proto = index.constant_tensor(name)
            head = None if proto is None else raw_values(proto, 1)
            if head is not None and value is not None and value.size:
                assert head[0] == value.reshape(-1)[0], where
    assert integers > 100  # the exports' shape arithmetic is full of them


@pytest.mark.parametrize(
    "data_type",
    [
        onnx.TensorProto.INT64,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT16,
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.UINT32,
        onnx.TensorProto.UINT64,
    ],
)
@pytest.mark.parametrize("dims", [(), (1,), (3,)])
def test_integers_in_their_typed_field_read_without_numpy_as_numpy_reads_them(
    data_type: int, dims: tuple[int, ...]
) -> None:
    # The multi-device model's length constants (graph/build.py) hold their values in the
    # typed field, as onnx.helper.make_tensor writes them; shape inference reads them so.
    values = [7, 0, 100][: dims[0] if dims else 1]
    tensor = oh.make_tensor("c", data_type, dims, values)
    assert not tensor.HasField("raw_data")
    expected = tuple(int(v) for v in numpy_helper.to_array(tensor).reshape(-1))
    assert raw_ints(tensor, dims) == expected == tuple(values)
    # A count that is not the tensor's is not read.
    assert raw_ints(tensor, (len(values) + 1,)) is None


def _square(name: str, matrix: np.ndarray, *, raw: bool = True) -> GraphIndex:
    tensor = (
        numpy_helper.from_array(matrix, name)
        if raw
        else oh.make_tensor(name, onnx.TensorProto.FLOAT, matrix.shape, matrix.reshape(-1))
    )
    graph = oh.make_graph([], "g", [], [oh.make_tensor_value_info(name, 1, matrix.shape)], [tensor])
    return GraphIndex(oh.make_model(graph))


def test_the_triangular_precheck_never_rules_out_what_the_full_check_accepts() -> None:
    rng = np.random.default_rng(20261130)
    for size in (2, 3, 5, 8):
        for matrix in (
            np.tril(np.ones((size, size), np.float32)),
            np.tril(rng.integers(1, 3, (size, size))).astype(np.float32),
            rng.integers(0, 2, (size, size)).astype(np.float32),
            np.triu(np.ones((size, size), np.float32), 1),
            rng.standard_normal((size, size)).astype(np.float32),
        ):
            for raw in (True, False):
                index = _square("m", matrix, raw=raw)
                if _is_triangular(matrix):
                    assert _may_be_triangular_constant(index, "m"), matrix


def test_the_triangular_check_read_with_struct_is_numpys() -> None:
    """A raw constant is checked from its values read with struct; one stored otherwise with
    numpy: both say what ``_is_triangular`` says of the array (bool, float, ints, a stack)."""
    rng = np.random.default_rng(20261201)
    matrices = []
    for size in (2, 3, 5, 8):
        for dtype in (np.float32, np.int64, np.bool_):
            matrices += [
                np.tril(np.ones((size, size))).astype(dtype),
                np.triu(np.ones((size, size)), 1).astype(dtype),
                np.zeros((size, size), dtype),
                rng.integers(0, 2, (size, size)).astype(dtype),
                np.tril(rng.integers(1, 3, (2, size, size))).astype(dtype),
            ]
        matrices.append(np.triu(np.full((size, size), -np.inf, np.float32), 1))
    accepted = 0
    for matrix in matrices:
        for raw in (True, False):
            if not raw and matrix.dtype != np.float32:
                continue  # _square's non-raw form writes floats
            index = _square("m", matrix, raw=raw)
            assert _is_triangular_constant(index, "m") == _is_triangular(matrix), matrix
        accepted += _is_triangular(matrix)
    assert accepted >= 12  # the lower-triangular ones of each size and type


def test_a_weight_met_on_the_mask_walk_is_ruled_out_from_its_first_row() -> None:
    weight = np.random.default_rng(7).standard_normal((64, 64)).astype(np.float32)
    index = _square("w", weight)
    assert not _may_be_triangular_constant(index, "w")
    assert "w" not in index._constant_cache  # its data was never read into an array
