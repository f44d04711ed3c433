"""The bad-input corpus: every command meets every bad file with exit 2 and one clear line.

The corpus is data (``CORPUS``, ``OUTPUTS``, ``OPTIONS``): files that a new user could hand
to shardcheck by mistake, or that a hand edit could leave behind. Each file entry is tried in
every position that reads a file (the model of gen, verify, shard and simulate; the hints of
verify, shard, simulate, diff and fmt; the manifest of check), each output entry as every
output path, each option entry as given. The answer must always be exit 2 and exactly one
stderr line ``shardcheck: error: ...`` that names the file, with no traceback and no "internal
error" (that is a bug to fix where it arises). Files that would be replaced are unchanged and
no temporary file is left behind.

The last part proves that a model whose external data points outside its directory is refused
without the file being opened: the target is a FIFO, whose open would block.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import Result
from conftest import FIXTURES, GOLDEN, ROOT, run_cli
from onnx import TensorProto, numpy_helper

from shardcheck.cli import COMMANDS

MODEL = FIXTURES / "attention_head.onnx"
HINTS = GOLDEN / "attention_head.json"

Maker = Callable[[Path], Path]


# ------------------------------------------------------------------ building the entries


def _write(name: str, data: bytes | str) -> Maker:
    def make(directory: Path) -> Path:
        path = directory / name
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        return path

    return make


def _hints_doc() -> dict:
    return json.loads(HINTS.read_text())


def _hints_with(change: Callable[[dict], object], name: str = "hints.json") -> Maker:
    document = _hints_doc()
    change(document)
    return _write(name, json.dumps(document, indent=4))


def _model_with(change: Callable[[onnx.ModelProto], object], name: str = "model.onnx") -> Maker:
    def make(directory: Path) -> Path:
        model = onnx.load(MODEL)
        change(model)
        path = directory / name
        path.write_bytes(model.SerializeToString())
        return path

    return make


def _rename_two_nodes(model: onnx.ModelProto) -> None:
    _name_two_nodes("same")(model)


def _name_two_nodes(name: str) -> Callable[[onnx.ModelProto], None]:
    def change(model: onnx.ModelProto) -> None:
        model.graph.node[0].name = name
        model.graph.node[1].name = name

    return change


def _external(location: str) -> Callable[[onnx.ModelProto], None]:
    def change(model: onnx.ModelProto) -> None:
        tensor = model.graph.initializer[0]
        tensor.ClearField("raw_data")
        tensor.ClearField("float_data")
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=location)

    return change


def _nested(directory: Path, make: Maker) -> Path:
    """``make`` in directory/a/b (for external locations that climb out with ../..)."""
    inner = directory / "a" / "b"
    inner.mkdir(parents=True, exist_ok=True)
    return make(inner)


def _missing(directory: Path) -> Path:
    return directory / "missing.onnx"


def _directory(directory: Path) -> Path:
    path = directory / "a_directory.onnx"
    path.mkdir()
    return path


def _symlink_loop(directory: Path) -> Path:
    path = directory / "loop.onnx"
    path.symlink_to(path.name)
    return path


def _dangling_symlink(directory: Path) -> Path:
    path = directory / "dangling.json"
    path.symlink_to(directory / "nowhere.json")
    return path


def _manifest(text: str) -> Maker:
    def make(directory: Path) -> Path:
        shutil.copy(MODEL, directory / "good_model.onnx")
        shutil.copy(HINTS, directory / "good_golden.json")
        return _write("shardcheck.toml", text)(directory)

    return make


_GOOD_ENTRY = '[[tool.shardcheck.models]]\npath = "good_model.onnx"\ngolden = "good_golden.json"\n'


@dataclass(frozen=True)
class Entry:
    """A file that is wrong in every position it is tried in, but those in ``valid_as``."""

    id: str
    make: Maker
    # What the line says, by the kind of file the position expects (model, hints, manifest).
    says: dict[str, str] = field(default_factory=dict)
    valid_as: frozenset[str] = frozenset()


def _everywhere(text: str) -> dict[str, str]:
    return {"model": text, "hints": text, "manifest": text}


def _everywhere_but_manifest(text: str) -> dict[str, str]:
    return {"model": text, "hints": text}


CORPUS: list[Entry] = [
    # --- any kind of file
    Entry("missing-file", _missing, _everywhere("no such file")),
    Entry("directory", _directory, _everywhere("directory")),
    Entry("name-too-long", lambda d: d / ("n" * 300 + ".onnx"), _everywhere("File name too long")),
    Entry("empty-file", _write("empty.onnx", b""), {"model": "empty file", "hints": "empty"}),
    Entry("whitespace-only", _write("blank.json", " \n\t\n"), {"hints": "empty file"}),
    # A device is no file: not "empty file".
    Entry(
        "dev-null",
        lambda _d: Path(os.devnull),
        _everywhere_but_manifest("is a device that gave nothing to read"),
    ),
    Entry("symlink-loop", _symlink_loop),
    Entry("dangling-symlink", _dangling_symlink, _everywhere("no such file")),
    Entry(
        "random-bytes",
        _write("random.onnx", random.Random(20240611).randbytes(4096)),
        {"model": "not a readable ONNX model", "hints": "not UTF-8"},
    ),
    # --- ONNX that is wrong
    Entry(
        "truncated-onnx",
        _write("truncated.onnx", MODEL.read_bytes()[: MODEL.stat().st_size // 2]),
        {"model": "not a readable ONNX model", "hints": "not UTF-8"},
    ),
    Entry(
        "protobuf-tensor-not-a-model",
        _write(
            "tensor.onnx",
            numpy_helper.from_array(np.ones(3, np.float32), "x").SerializeToString(),
        ),
        {"model": "not a readable ONNX model"},
    ),
    Entry(
        "protobuf-graph-not-a-model",
        _write("graph.onnx", onnx.load(MODEL).graph.SerializeToString()),
        {"model": "not an ONNX model"},
    ),
    Entry(
        "fails-onnx-checker",
        _model_with(lambda m: setattr(m.graph.node[0], "op_type", "NoSuchOp")),
        {"model": "fails onnx.checker"},
    ),
    Entry(
        "duplicate-node-names",
        _model_with(_rename_two_nodes),
        {"model": "duplicate node names 'same'"},
    ),
    Entry(
        "duplicate-node-names-with-escapes",
        _model_with(_name_two_nodes("\x1b[2J\nPASS")),
        {"model": "duplicate node names '\\x1b[2J\\nPASS'"},
    ),
    Entry(
        "external-data-outside",
        lambda d: _nested(d, _model_with(_external("../../something"))),
        {"model": "outside the model's directory; refused"},
    ),
    Entry(
        "external-data-absolute",
        _model_with(_external("/etc/passwd")),
        {"model": "outside the model's directory; refused"},
    ),
    Entry(
        "external-data-nul-byte",
        _model_with(_external("weights\0.bin")),
        {"model": 'external data location "weights\\u0000.bin" holds a NUL byte'},
    ),
    Entry(
        "external-data-name-too-long",
        _model_with(_external("w" * 300)),
        {"model": "is too long to be a file name"},
    ),
    Entry(
        "external-data-path-too-long",
        _model_with(_external("d/" * 2100 + "w.bin")),
        {"model": "is too long to be a file name"},
    ),
    Entry(
        "external-data-without-location",
        _model_with(_external("")),
        {"model": "external data has no location"},
    ),
    Entry(
        "hints-given-as-model",
        _write("attention_head.json", HINTS.read_text()),
        {"model": "not a readable ONNX model"},
        valid_as=frozenset({"hints"}),
    ),
    Entry(
        "model-given-as-hints",
        _write("model.json", MODEL.read_bytes()),
        {"hints": "not UTF-8"},
        valid_as=frozenset({"model"}),
    ),
    Entry("textproto-garbage", _write("m.textproto", "garbage {{"), {"model": "not a readable"}),
    Entry("onnxtxt-garbage", _write("m.onnxtxt", "<ir_version: 8> g (float[N] X) => ("), {}),
    # --- JSON that is wrong
    Entry(
        "json-syntax", _write("syntax.json", '{"parallelism": "CP",'), {"hints": "not valid JSON"}
    ),
    Entry("json-list", _write("list.json", "[1, 2]"), {"hints": "expected a JSON object"}),
    Entry("json-empty-object", _write("obj.json", "{}"), {"hints": "missing 'polygraphy_class'"}),
    Entry("json-nan", _write("nan.json", '{"k_seq_len_idx": NaN}'), {"hints": "NaN"}),
    Entry(
        "json-deep-nesting", _write("deep.json", "[" * 100_000 + "]" * 100_000), {"hints": "deep"}
    ),
    Entry(
        "json-huge-integer-literal",
        _write("bigint.json", '{"k_seq_len_idx": ' + "9" * 5000 + "}"),
        {"hints": "not valid JSON"},
    ),
    Entry(
        "json-utf8-bom",
        _write("bom.json", b"\xef\xbb\xbf" + HINTS.read_bytes()),
        {"hints": "BOM"},
    ),
    Entry(
        "json-utf16", _write("utf16.json", HINTS.read_text().encode("utf-16")), {"hints": "UTF-8"}
    ),
    Entry(
        "json-wrong-type",
        _hints_with(lambda d: d.update(k_seq_len_idx="1")),
        {"hints": 'k_seq_len_idx: expected an integer, got "1"'},
    ),
    Entry(
        "json-wrong-shape",
        _hints_with(lambda d: d.update(inputs={"name": "input"})),
        {"hints": "inputs: expected a list"},
    ),
    Entry(
        "unknown-polygraphy-class",
        _hints_with(lambda d: d.update(polygraphy_class="Evil")),
        {"hints": "polygraphy_class: expected 'ShardHints', got \"Evil\""},
    ),
    Entry(
        "unknown-nested-polygraphy-class",
        _hints_with(lambda d: d["inputs"][0].update(polygraphy_class="os.system")),
        {"hints": "inputs[0].polygraphy_class: expected 'ShardTensor'"},
    ),
    Entry(
        "missing-polygraphy-class",
        _hints_with(lambda d: d["dist_collectives"].pop("polygraphy_class")),
        {"hints": "dist_collectives: missing 'polygraphy_class'"},
    ),
    Entry(
        "negative-index",
        _hints_with(lambda d: d["inputs"][0].update(seq_len_idx=-1)),
        {"hints": "inputs[0].seq_len_idx: expected an integer between 0 and 63, got -1"},
    ),
    Entry(
        "huge-index",
        _hints_with(lambda d: d.update(k_seq_len_idx=10**30)),
        {"hints": "k_seq_len_idx: expected an integer between 0 and 63"},
    ),
    Entry(
        "huge-rank",
        _hints_with(lambda d: d["outputs"][0].update(rank=2**63)),
        {"hints": "outputs[0].rank: expected an integer between 1 and 64"},
    ),
    Entry(
        "float-index",
        _hints_with(lambda d: d.update(v_seq_len_idx=1.0)),
        {"hints": "v_seq_len_idx: expected an integer, got 1.0"},
    ),
    Entry(
        "misspelt-key",
        _hints_with(lambda d: d["inputs"][0].update(seq_len_index=1)),
        {"hints": "inputs[0].seq_len_index: unknown key"},
    ),
    Entry(
        "key-given-twice",
        _write(
            "twice.json", HINTS.read_text().replace('"kv_rank": 3', '"kv_rank": 3, "kv_rank": 2')
        ),
        {"hints": "kv_rank: key given twice"},
    ),
    # A name that would set the terminal's title and forge a line: shown escaped.
    Entry(
        "key-with-terminal-escape",
        _hints_with(lambda d: d["inputs"][0].update({"\x1b]0;owned\x07\nPASS": 1})),
        # The error line's white space is folded (the newline is a space), ESC and BEL escaped.
        {"hints": "inputs[0].\\x1b]0;owned\\x07 PASS: unknown key"},
    ),
    Entry(
        "lone-surrogate-name",
        _hints_with(lambda d: d["inputs"][0].update(name="\ud800x")),
        {"hints": "inputs[0].name: expected a tensor name, got invalid Unicode"},
    ),
    Entry(
        "flat-format-wrong-type",
        _write(
            "flat.json",
            json.dumps(
                {
                    **{k: v for k, v in _hints_doc().items() if k != "dist_collectives"},
                    "group_size": "2",
                }
            ),
        ),
        {"hints": 'group_size: expected an integer, got "2"'},
    ),
    # --- manifests that are wrong
    Entry("toml-syntax", _manifest("[[tool.shardcheck.models]\n"), {"manifest": "not valid TOML"}),
    Entry(
        "toml-no-table", _manifest("[tool.other]\nx = 1\n"), {"manifest": "no [tool.shardcheck]"}
    ),
    Entry(
        "toml-models-wrong-type",
        _manifest("[tool.shardcheck]\nmodels = 3\n"),
        {"manifest": "tool.shardcheck.models"},
    ),
    Entry(
        "toml-gen-option-out-of-range",
        _manifest(_GOOD_ENTRY + "gen = { i-idx = 99999 }\n"),
        {"manifest": "gen option 'i-idx': expected an integer between 0 and 63, got 99999"},
    ),
]


SIMULATE_SETTINGS = ("--ranks", "2", "--seq-len", "8")


def _positions(good: dict[str, Path], out: Path) -> dict[str, Callable[[Path], list[object]]]:
    """Every command, and each position in it that reads a file: name -> argv for a file."""
    model, hints = good["model"], good["hints"]
    positions: dict[str, Callable[[Path], list[object]]] = {
        "gen MODEL": lambda f: ["gen", f, "-o", out],
        "verify MODEL": lambda f: ["verify", f, hints],
        "verify HINTS": lambda f: ["verify", model, f],
        "shard MODEL": lambda f: ["shard", f, hints, "-o", out],
        "shard HINTS": lambda f: ["shard", model, f, "-o", out],
        "diff GOLDEN": lambda f: ["diff", f, hints],
        "diff CANDIDATE": lambda f: ["diff", hints, f],
        "fmt HINTS": lambda f: ["fmt", f, "-o", out],
        "check MANIFEST": lambda f: ["check", "--manifest", f],
    }
    positions["simulate MODEL"] = lambda f: ["simulate", f, hints, *SIMULATE_SETTINGS]
    positions["simulate HINTS"] = lambda f: ["simulate", model, f, *SIMULATE_SETTINGS]
    positions["explain MODEL"] = lambda f: ["explain", f, hints, "--seq-len", "8"]
    positions["explain HINTS"] = lambda f: ["explain", model, f, "--seq-len", "8"]
    return positions


# The kind of file that each position expects (an entry may be valid as one kind).
POSITION_KINDS = {
    "MODEL": "model",
    "HINTS": "hints",
    "GOLDEN": "hints",
    "CANDIDATE": "hints",
    "MANIFEST": "manifest",
}
ALL_POSITIONS = list(_positions({"model": MODEL, "hints": HINTS}, Path("out")))


def _good_inputs(directory: Path) -> dict[str, Path]:
    good = directory / "good"
    good.mkdir()
    shutil.copy(MODEL, good / "model.onnx")
    shutil.copy(HINTS, good / "hints.json")
    return {"model": good / "model.onnx", "hints": good / "hints.json"}


def assert_one_clean_error(result: Result, *, names: str | None = None, says: str = "") -> str:
    """Exit 2, and stderr is exactly one line 'shardcheck: error: ...' (no traceback)."""
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, f"exit {result.exit_code}, stderr {result.stderr!r}"
    assert len(lines) == 1, f"expected one stderr line, got {result.stderr!r}"
    line = lines[0]
    assert line.startswith("shardcheck: error: "), line
    assert "Traceback" not in line and "internal error" not in line, line
    # A value is cut (wording.shown): no number is echoed in hundreds of digits.
    assert not re.search(r"[0-9]{100}", line), f"a long number echoed in full: {line!r}"
    # Names are shown escaped: no terminal escape or other control character is raw.
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", line), f"a raw control character: {line!r}"
    if names is not None:
        assert names in line, f"{names!r} not named in {line!r}"
    assert says in line, f"{says!r} not in {line!r}"
    return line


def _snapshot(directory: Path) -> dict[str, bytes]:
    """The bytes of every file under ``directory`` (to see that nothing changed)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


# ------------------------------------------------------------------ the runner


CASES = [
    pytest.param(entry, position, id=f"{entry.id}:{position}")
    for entry in CORPUS
    for position in ALL_POSITIONS
    if POSITION_KINDS[position.split()[1]] not in entry.valid_as
]


@pytest.mark.parametrize(("entry", "position"), CASES)
def test_every_command_gives_one_clean_line_for_every_bad_file(
    tmp_path: Path, entry: Entry, position: str
) -> None:
    good = _good_inputs(tmp_path)
    out = tmp_path / "out" / "written"
    out.parent.mkdir()
    bad = entry.make(tmp_path)
    before = _snapshot(tmp_path)

    result = run_cli(*_positions(good, out)[position](bad))

    kind = POSITION_KINDS[position.split()[1]]
    assert_one_clean_error(result, names=bad.name, says=entry.says.get(kind, ""))
    assert _snapshot(tmp_path) == before, "a bad input changed or left a file"


def test_the_corpus_covers_every_command() -> None:
    commands = {position.split()[0] for position in ALL_POSITIONS}
    assert set(COMMANDS) <= commands, "add the new command to _positions"
    assert {"gen", "verify", "diff", "check", "shard"} <= commands


# ------------------------------------------------------------------ output paths


def _unwritable_directory(directory: Path) -> Path:
    """A directory where no file can be created, even by root (CI runs as root)."""
    if os.geteuid() != 0:
        locked = directory / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        return locked
    for candidate in (Path("/sys"), Path("/proc")):
        try:
            handle, name = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(handle)
        os.unlink(name)
    pytest.skip("no unwritable directory on this machine")


def _save_with_external_weights(directory: Path) -> tuple[Path, Path]:
    model = onnx.load(MODEL)
    path = directory / "external.onnx"
    onnx.save_model(
        model, path, save_as_external_data=True, location="external.onnx.data", size_threshold=0
    )
    return path, directory / "external.onnx.data"


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda weights: weights.unlink(), "external weight file 'external.onnx.data' of tensor"),
        (
            lambda weights: weights.write_bytes(weights.read_bytes()[:-1]),
            "of 'external.onnx.data', which has",
        ),
    ],
    ids=["missing", "truncated"],
)
def test_verify_and_shard_refuse_a_model_whose_weight_file_is_missing_or_short(
    tmp_path: Path, damage: Callable[[Path], None], says: str
) -> None:
    """gen never reads the weights; verify runs the model, so it needs them whole. The file
    is looked at before onnxruntime is asked to read it. shard would copy it, or refer to it,
    as it is."""
    model, weights = _save_with_external_weights(tmp_path)
    damage(weights)
    assert run_cli("gen", model, "-o", tmp_path / "h.json").exit_code == 0
    for ranks in ([], ["--ranks", "2"]):
        result = run_cli("verify", model, tmp_path / "h.json", *ranks)
        assert_one_clean_error(result, names=str(model), says=says)
    (tmp_path / "out").mkdir()
    sharded = tmp_path / "out" / "md.onnx"
    assert_one_clean_error(run_cli("shard", model, tmp_path / "h.json", "-o", sharded), says=says)
    assert list((tmp_path / "out").iterdir()) == []


# name -> (commands it applies to, where the output goes given (tmp, good inputs), says)
OUTPUTS: dict[str, tuple[tuple[str, ...], Callable[[Path, dict[str, Path]], str], str]] = {
    "missing-directory": (
        ("gen", "shard", "fmt", "check"),
        lambda d, g: str(d / "no_such_dir" / "out"),
        "directory",
    ),
    "parent-is-a-file": (
        ("gen", "shard", "fmt", "check"),
        lambda d, g: str(g["model"] / "out"),
        "is not a directory",
    ),
    "is-a-directory": (("gen", "shard", "fmt", "check"), lambda d, g: str(d), "directory"),
    # Path() drops a final slash: "out/" was written as a file named "out".
    "ends-with-a-slash": (
        ("gen", "shard", "fmt", "check"),
        lambda d, g: str(d / "out") + "/",
        "the path names a directory",
    ),
    "empty-path": (("gen", "shard", "fmt", "check"), lambda d, g: "", "empty"),
    "not-writable": (
        ("gen", "shard", "fmt", "check"),
        lambda d, g: str(_unwritable_directory(d) / "out.json"),
        "cannot write",
    ),
    "same-as-model": (("gen", "shard"), lambda d, g: str(g["model"]), "is the input model"),
    "same-as-hints": (("shard",), lambda d, g: str(g["hints"]), "is the hints file"),
    "same-as-weight-file": (("gen", "shard"), lambda d, g: str(g["weights"]), "weight file"),
    # shard copies the weights next to its output: there the model would overwrite them.
    "named-like-a-weight-file": (
        ("shard",),
        lambda d, g: str(_made(d / "elsewhere") / g["weights"].name),
        "where the model's weight file",
    ),
}


def _made(directory: Path) -> Path:
    directory.mkdir()
    return directory


def _output_argv(command: str, good: dict[str, Path], output: str) -> list[object]:
    if command == "gen":
        return ["gen", good["model"], "-o", output]
    if command == "shard":
        return ["shard", good["model"], good["hints"], "-o", output]
    if command == "fmt":
        return ["fmt", good["hints"], "-o", output]
    return ["check", "--manifest", good["manifest"], "--report", output]


@pytest.mark.parametrize(
    ("name", "command"),
    [
        pytest.param(name, command, id=f"{name}:{command}")
        for name, (commands, _, _) in OUTPUTS.items()
        for command in commands
    ],
)
def test_bad_output_paths_are_one_clean_line_and_change_nothing(
    tmp_path: Path, name: str, command: str
) -> None:
    good_dir = tmp_path / "good"
    good_dir.mkdir()
    model, weights = _save_with_external_weights(good_dir)
    shutil.copy(HINTS, good_dir / "hints.json")
    manifest = good_dir / "shardcheck.toml"
    manifest.write_text(
        '[[tool.shardcheck.models]]\npath = "external.onnx"\ngolden = "hints.json"\n'
    )
    good = {"model": model, "hints": good_dir / "hints.json", "weights": weights}
    good["manifest"] = manifest
    _, where, says = OUTPUTS[name]
    output = where(tmp_path, good)
    before = _snapshot(tmp_path)

    result = run_cli(*_output_argv(command, good, output))

    line = assert_one_clean_error(result, says=says)
    if output:  # the output, or (shard) the first weight file it would copy next to it
        assert str(Path(output).parent) in line
    assert _snapshot(tmp_path) == before, "a failed write changed a file or left a temporary"


# ------------------------------------------------------------------ names shown on stdout

# A tensor name that, printed raw, would clear the screen and forge a line of its own.
FORGING_NAME = "input\x1b[2J\nPASS: 0 error(s), 0 warning(s)"
NAME_RUNS: dict[str, Callable[[Path], list[object]]] = {
    "verify": lambda h: ["verify", MODEL, h],
    "verify --ranks 2": lambda h: ["verify", MODEL, h, "--ranks", "2"],
    "diff": lambda h: ["diff", HINTS, h],
    "simulate": lambda h: ["simulate", MODEL, h, *SIMULATE_SETTINGS],
}


@pytest.mark.parametrize("run", list(NAME_RUNS))
def test_names_reach_the_terminal_escaped(tmp_path: Path, run: str) -> None:
    """The hints name a tensor the model lacks, whose name holds an escape and a newline:
    every command that shows it shows it escaped, and no line is forged."""
    hints = _hints_with(lambda d: d["inputs"][0].update(name=FORGING_NAME))(tmp_path)
    result = run_cli(*NAME_RUNS[run](hints))
    assert result.exit_code in (1, 2), result.stderr
    for text in (result.stdout, result.stderr):
        assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text), text
        assert not any(line.startswith("PASS: 0 error(s)") for line in text.splitlines())
    assert "\\x1b[2J\\nPASS" in result.stdout + result.stderr


# ------------------------------------------------------------------ odd but valid models


def _dim_named(name: str) -> Callable[[onnx.ModelProto], None]:
    def change(model: onnx.ModelProto) -> None:
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = name

    return change


def _weight_as_output(model: onnx.ModelProto) -> None:
    weight = model.graph.initializer[0]
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(weight.name, weight.data_type, list(weight.dims))
    )


# Models every command must take as they are: no "internal error", no false refusal.
ODD_MODELS: dict[str, Callable[[onnx.ModelProto], None]] = {
    # A dim named in digits of another kind: a name, not a number.
    "dim-param-superscript": _dim_named("\u00b2"),
    # A dim named like a product: a name, never multiplied out (8e44 bytes "needed").
    "dim-param-like-a-product": _dim_named("99999999999*99999999999"),
    "dim-param-with-a-space": _dim_named("batch size"),
    # A weight given out as a graph output (the simulation compared it as a rank's tensor).
    "initializer-as-graph-output": _weight_as_output,
}
ODD_RUNS: dict[str, Callable[[Path, Path, Path], list[object]]] = {
    "gen": lambda m, h, d: ["gen", m, "-o", d / "gen.json"],
    "verify": lambda m, h, d: ["verify", m, h],
    "verify --ranks 2": lambda m, h, d: ["verify", m, h, "--ranks", "2"],
    "simulate": lambda m, h, d: ["simulate", m, h, *SIMULATE_SETTINGS],
    "shard": lambda m, h, d: ["shard", m, h, "-o", d / "md.onnx"],
}


@pytest.mark.parametrize("run", list(ODD_RUNS))
@pytest.mark.parametrize("odd", list(ODD_MODELS))
def test_odd_but_valid_models_pass_every_command(tmp_path: Path, odd: str, run: str) -> None:
    model = _model_with(ODD_MODELS[odd])(tmp_path)
    result = run_cli(*ODD_RUNS[run](model, HINTS, tmp_path))
    assert result.exit_code == 0, result.stderr
    assert "error" not in result.stderr


@pytest.mark.parametrize("command", ["gen", "fmt", "shard"])
def test_a_long_legal_output_name_is_written(tmp_path: Path, command: str) -> None:
    """250 bytes is a legal file name; the temporary file beside it must not be longer than
    the 255 a name may have (it was ".NAME.XXXXXXXX.tmp")."""
    good = _good_inputs(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    name = "h" * 245 + ".json"
    argv = {
        "gen": ["gen", good["model"], "-o", out_dir / name],
        "fmt": ["fmt", good["hints"], "-o", out_dir / name],
        "shard": ["shard", good["model"], good["hints"], "-o", out_dir / name],
    }[command]
    result = run_cli(*argv)
    assert result.exit_code == 0, result.stderr
    assert [p.name for p in out_dir.iterdir()] == [name]


# ------------------------------------------------------------------ options and run settings


def _model_with_negative_dim(directory: Path) -> Path:
    model = onnx.load(MODEL)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
    path = directory / "negative_dim.onnx"
    path.write_bytes(model.SerializeToString())
    return path


HUGE = str(10**11)
# Too large for a float (1e400 written out), and digits of other scripts (int() takes "١٦").
DIGITS_400 = str(10**400)
SUPERSCRIPT_TWO = "\u00b2"
ARABIC_SIXTEEN = "\u0661\u0666"

# (argv with MODEL/HINTS placeholders, what the line says). Each is exit 2 and one line.
OPTIONS: list[tuple[list[str], str]] = [
    (["gen", "MODEL", "-o", "-", "--i-idx", "-1"], "--i-idx: expected an integer between 0"),
    (["gen", "MODEL", "-o", "-", "--i-idx", "99999"], "got 99999"),
    (["gen", "MODEL", "-o", "-", "--o-idx", str(10**30)], "--o-idx"),
    (["gen", "MODEL", "-o", "-", "--k-idx", "64"], "--k-idx"),
    # attention_head's gathered K and V have rank 3.
    (["gen", "MODEL", "-o", "-", "--k-idx", "3"], "--k-idx 3: past the rank of the gathered K"),
    (["gen", "MODEL", "-o", "-", "--v-idx", "5"], "--v-idx 5: past the rank of the gathered K"),
    (["gen", "MODEL", "-o", "-", "--kv-rank", "65"], "--kv-rank"),
    (["gen", "MODEL", "-o", "-", "--nb-rank", "0"], "--nb-rank"),
    (["gen", "MODEL", "-o", "-", "--root", "-2"], "--root"),
    (["gen", "MODEL", "-o", "-", "--gpus", "-1"], "--gpus"),
    (
        ["gen", "MODEL", "-o", "-", "--gpus", "2", "--root", "2"],
        "--root: 2 is not a rank of a group of 2 GPUs",
    ),
    (["gen", "MODEL", "-o", "-", "--groups", HUGE], "--groups"),
    # Meant as lists: the option says what is wrong, not "unexpected extra argument".
    (["gen", "MODEL", "-o", "-", "--groups", "1,2,x"], "--groups': expected integers"),
    (["gen", "MODEL", "-o", "-", "--groups", "0", "-1"], "expected non-negative integers"),
    (["gen", "MODEL", "-o", "-", "--q-shuffle", "1.5"], "--q-shuffle': expected integers"),
    (["gen", "MODEL", "-o", "-", "--cp-type", "fused", "--q-shuffle", "65"], "--q-shuffle"),
    (["gen", "MODEL", "-o", "-", "--parallelism", "XP"], "--parallelism"),
    (["gen", "MODEL"], "-o"),
    (["verify", "MODEL", "HINTS", "--seq-lens", "8"], "at least two"),
    (["verify", "MODEL", "HINTS", "--seq-lens", "0,8"], "positive"),
    (["verify", "MODEL", "HINTS", "--seq-lens", "a,b"], "--seq-lens"),
    (["verify", "MODEL", "HINTS", "--seq-lens", f"8,{HUGE}"], f"sequence length {HUGE}"),
    (["verify", "MODEL", "HINTS", "--dim", f"batch={HUGE}"], f"batch={HUGE}"),
    (["verify", "MODEL", "HINTS", "--dim", "nosuch=3"], "the model's inputs have no dim 'nosuch'"),
    (["verify", "MODEL", "HINTS", "--seq-lens", f"8,{DIGITS_400}"], "sequence length 1000"),
    (["verify", "MODEL", "HINTS", "--dim", f"batch={DIGITS_400}"], "dims batch=1000"),
    (["verify", "MODEL", "HINTS", "--ranks", "2", "--seq-lens", f"8,{DIGITS_400}"], "length 100"),
    (["verify", "MODEL", "HINTS", "--dim", f"batch={SUPERSCRIPT_TWO}"], "positive integer"),
    (["verify", "MODEL", "HINTS", "--seq-lens", f"8,{ARABIC_SIXTEEN}"], "--seq-lens"),
    (["gen", "MODEL", "-o", "-", "--groups", f"0,{SUPERSCRIPT_TWO}"], "--groups"),
    (["gen", "MODEL", "-o", "-", "--i-idx", DIGITS_400], "--i-idx"),
    (["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", DIGITS_400], "length 1000"),
    (["simulate", "MODEL", "HINTS", "--ranks", DIGITS_400, "--seq-len", "8"], "--seq-len 8"),
    (
        ["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", "8", "--dim", "batch=1e3"],
        "positive integer",
    ),
    (
        ["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", "8"]
        + ["--dim", f"batch={DIGITS_400}"],
        "dims batch=1000",
    ),
    (["verify", "MODEL", "HINTS", "--dim", "batch"], "--dim"),
    # The sequence dim pinned: every run would be the same.
    (
        ["verify", "MODEL", "HINTS", "--dim", "sequence_len=8"],
        "--dim sequence_len=8: 'sequence_len' is a sequence dim, which verify sets to each",
    ),
    (["verify", "MODEL", "HINTS", "--seed", "-1"], "--seed -1"),
    (["verify", "MODEL", "HINTS", "--timeout", "0"], "--timeout"),
    (["verify", "MODEL", "HINTS", "--timeout", "nan"], "--timeout nan"),
    (["verify", "MODEL", "HINTS", "--timeout", "inf"], "--timeout inf"),
    (
        ["verify", "MODEL", "HINTS", "--ranks", "3"],
        "--ranks 3: every sequence length must be a multiple of the number of ranks (8 and 16 "
        "are not)",
    ),
    (
        ["verify", "MODEL", "HINTS", "--ranks", "2", "--seq-lens", "8,9"],
        "--ranks 2: every sequence length must be a multiple of the number of ranks (9 is not)",
    ),
    (["verify", "MODEL", "HINTS", "--rtol", "nan"], "--rtol nan"),
    (["verify", "MODEL", "HINTS", "--atol", "-1"], "--atol -1.0"),
    (["verify", "NEGDIM", "HINTS"], "negative size -1"),
    (["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", "7"], "--seq-len 7"),
    (["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", HUGE], f"length {HUGE}"),
    (["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", "8", "--seed", "-1"], "--seed"),
    (
        ["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", "8", "--dim", "sequence_len=4"],
        "--dim sequence_len=4: 'sequence_len' is the sequence dim (the hinted axes carry it)",
    ),
    (["simulate", "MODEL", "HINTS", "--ranks", "2", "--seq-len", "8", "--rtol", "inf"], "--rtol"),
    (["shard", "MODEL", "UNFIT", "-o", "OUT"], "'nope' is not in the model"),
    (["shard", "MODEL", "HINTS", "-o", "-"], "-o -: shard writes an ONNX model file"),
    (["diff", "HINTS"], "CANDIDATE"),
    (["gen", "", "-o", "-"], "'': the model path is empty"),
    (["diff", "", "HINTS"], "'': the path of a JSON hints file is empty"),
    (["diff", "-", "HINTS"], "-: reading a JSON hints file from standard input is not supported"),
    (["check", "--manifest", "-"], "-: reading the manifest from standard input is not"),
    (["check", "--manifest", "NOWHERE"], "no such file"),
]


@pytest.mark.parametrize(("argv", "says"), OPTIONS, ids=[" ".join(a) for a, _ in OPTIONS])
def test_bad_options_and_run_settings_are_one_clean_line(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    unfit = tmp_path / "unfit.json"
    unfit.write_text(HINTS.read_text().replace('"name": "input"', '"name": "nope"'))
    values = {
        "MODEL": MODEL,
        "HINTS": HINTS,
        "UNFIT": unfit,
        "NEGDIM": _model_with_negative_dim(tmp_path),
        "OUT": tmp_path / "out.onnx",
        "NOWHERE": tmp_path / "nowhere.toml",
    }
    result = run_cli(*[values.get(arg, arg) for arg in argv])
    assert_one_clean_error(result, says=says)
    assert not (tmp_path / "out.onnx").exists()


def test_hints_that_do_not_fit_the_model_are_findings_of_verify(tmp_path: Path) -> None:
    """Well-formed hints that name a tensor the model lacks: exit 1, not an input error."""
    unfit = tmp_path / "unfit.json"
    unfit.write_text(HINTS.read_text().replace('"name": "input"', '"name": "nope"'))
    result = run_cli("verify", MODEL, unfit)
    assert result.exit_code == 1
    assert "SC102" in result.stdout
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = _write("syntax.json", "{")(tmp_path)
    result = run_cli("--debug", "diff", bad, HINTS)
    assert result.exit_code == 2
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("shardcheck: error: ")


def test_a_real_process_gives_the_same_answer(tmp_path: Path) -> None:
    """The installed entry point (not CliRunner): real exit codes, real stderr."""
    for entry_id, argv in (
        ("random-bytes", ["gen", "BAD", "-o", "-"]),
        ("lone-surrogate-name", ["diff", str(HINTS), "BAD"]),
        ("onnxtxt-garbage", ["verify", "BAD", str(HINTS)]),
    ):
        entry = next(e for e in CORPUS if e.id == entry_id)
        bad = entry.make(tmp_path)
        process = subprocess.run(
            [sys.executable, "-m", "shardcheck", *(str(bad) if a == "BAD" else a for a in argv)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert process.returncode == 2, process.stderr
        assert process.stdout == ""
        assert len(process.stderr.splitlines()) == 1, process.stderr
        assert process.stderr.startswith(f"shardcheck: error: {bad}: ")


# ------------------------------------------------------------------ external data, never opened

# A script run in a child process: every command on a model whose external data is a FIFO.
# Opening a FIFO for reading blocks until a writer comes, and none ever does: if any command
# opened it, the child would hang and be killed by the timeout.
_NEVER_OPENED = """
import json, sys
from click.testing import CliRunner
from shardcheck.cli import cli
model, hints, out, manifest = sys.argv[1:5]
runs = {
    "gen": ["gen", model, "-o", out],
    "verify": ["verify", model, hints],
    "shard": ["shard", model, hints, "-o", out],
    "simulate": ["simulate", model, hints, "--ranks", "2", "--seq-len", "8"],
    "check": ["check", "--manifest", manifest],
}
results = {}
try:
    runner = CliRunner(mix_stderr=False)  # click 8.1 mixes stderr into stdout by default
except TypeError:
    runner = CliRunner()  # click 8.2 and later keep them apart
for name, argv in runs.items():
    r = runner.invoke(cli, argv, catch_exceptions=False)
    results[name] = [r.exit_code, r.stderr, r.stdout]
print(json.dumps(results))
"""


def _fifo_model(tmp_path: Path, location: str) -> tuple[Path, Path]:
    """tmp/outside/fifo (the FIFO) and tmp/project/models/model.onnx pointing at ``location``."""
    fifo = tmp_path / "outside" / "fifo"
    fifo.parent.mkdir(exist_ok=True)
    if not fifo.exists():
        os.mkfifo(fifo)
    models = tmp_path / "project" / "models"
    models.mkdir(parents=True, exist_ok=True)
    model = models / "model.onnx"
    _model_with(_external(location.replace("FIFO", str(fifo))))(models).rename(model)
    return model, fifo


def _run_child(tmp_path: Path, model: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    manifest = model.parent / "shardcheck.toml"
    manifest.write_text(f'[[tool.shardcheck.models]]\npath = "{model.name}"\ngolden = "g.json"\n')
    argv = [str(model), str(HINTS), str(tmp_path / "o"), str(manifest)]
    return subprocess.run(
        [sys.executable, "-c", _NEVER_OPENED, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize(
    "location",
    ["../../outside/fifo", "FIFO", "models/../../../outside/fifo", "link_to_fifo"],
    ids=["relative", "absolute", "climbing", "symlink-inside"],
)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_external_data_outside_is_refused_without_opening_it(tmp_path: Path, location: str) -> None:
    model, fifo = _fifo_model(tmp_path, location)
    if location == "link_to_fifo":
        (model.parent / "link_to_fifo").symlink_to(fifo)

    child = _run_child(tmp_path, model, timeout=60)  # a hang would end in TimeoutExpired

    assert child.returncode == 0, child.stderr
    results = json.loads(child.stdout)
    assert {"gen", "verify", "shard", "check"} <= set(results)
    for name, (code, stderr, stdout) in results.items():
        message = stderr if name != "check" else stdout
        assert "outside the model's directory; refused" in message, (name, stderr, stdout)
        if name == "check":
            assert code == 1  # a model of the manifest that fails is a failed entry
        else:
            assert code == 2 and len(stderr.splitlines()) == 1, (name, stderr)
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_the_fifo_proof_would_see_an_open(tmp_path: Path) -> None:
    """Control: a command that does open the FIFO (read as a hints file, as a pipe is) hangs
    and meets the timeout. So the test above would have seen an open of the outside target."""
    _, fifo = _fifo_model(tmp_path, "../../outside/fifo")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-m", "shardcheck", "diff", str(fifo), str(HINTS)],
            capture_output=True,
            timeout=3,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
