"""Issue 30's gating cases: nothing written outside the manifest's directory or over a file that
is not a golden, every bad manifest one line and exit 2, no read that can block."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, run_cli

from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.loader import load_index
from shardcheck.hints.codec import dumps

SETTINGS = '{"editor": "vim", "tabs": 4}\n'  # a user's JSON file that no golden may replace


def project(directory: Path, golden: str = "golden/attention.json", *, extra: str = "") -> Path:
    """fixtures/attention.onnx and a manifest giving it ``golden`` (not written here)."""
    (directory / "fixtures").mkdir(exist_ok=True)
    shutil.copy(FIXTURES / "attention.onnx", directory / "fixtures" / "attention.onnx")
    manifest = directory / "shardcheck.toml"
    manifest.write_text(
        f"[tool.shardcheck]\n{extra}[[tool.shardcheck.models]]\n"
        f'path = "fixtures/attention.onnx"\ngolden = {json.dumps(golden)}\n'
    )
    return manifest


def one_error_line(result: object, expected_end: str) -> None:
    assert result.exit_code == 2, result.stdout  # type: ignore[attr-defined]
    assert result.stdout == ""  # type: ignore[attr-defined]
    lines = result.stderr.splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1, lines
    assert lines[0].startswith("shardcheck: error: "), lines
    assert lines[0].endswith(expected_end), lines[0]
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr  # type: ignore[attr-defined]


@pytest.mark.parametrize("option", [(), ("--update",)])
def test_a_golden_outside_the_manifest_directory_is_a_manifest_error(
    tmp_path: Path, option: tuple[str, ...]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "settings.json").write_text(SETTINGS)
    inside = tmp_path / "project"
    inside.mkdir()
    manifest = project(inside, "../outside/settings.json")

    result = run_cli("check", "--manifest", manifest, *option)

    one_error_line(
        result,
        f'tool.shardcheck.models[0].golden: "../outside/settings.json" resolves outside the '
        f"manifest's directory (to {outside / 'settings.json'}); give a path inside it",
    )
    assert (outside / "settings.json").read_text() == SETTINGS


def test_an_absolute_golden_and_a_golden_dir_outside_are_refused(tmp_path: Path) -> None:
    absolute = project(tmp_path, str(tmp_path / "golden" / "attention.json"))
    one_error_line(
        run_cli("check", "--manifest", absolute, "--update"),
        "is an absolute path; give a path inside the manifest's directory",
    )
    assert not (tmp_path / "golden").exists()

    outside_dir = project(tmp_path, extra='golden-dir = "../elsewhere"\n')
    one_error_line(
        run_cli("check", "--manifest", outside_dir, "--update"),
        "give a path inside it",
    )
    assert "tool.shardcheck.golden-dir" in run_cli("check", "--manifest", outside_dir).stderr
    assert not (tmp_path / "golden").exists()


def test_a_golden_through_a_link_leading_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    inside = tmp_path / "project"
    inside.mkdir()
    (inside / "golden").symlink_to(outside)
    manifest = project(inside)

    one_error_line(run_cli("check", "--manifest", manifest, "--update"), "give a path inside it")
    assert list(outside.iterdir()) == []


def test_a_golden_naming_the_manifest_or_a_model_is_refused(tmp_path: Path) -> None:
    # A manifest may have any name; one named .json could be given as its own golden.
    manifest = project(tmp_path, "gate.json")
    own = manifest.rename(tmp_path / "gate.json")
    text = own.read_text()
    one_error_line(
        run_cli("check", "--manifest", own, "--update"),
        'tool.shardcheck.models[0].golden: "gate.json" is the manifest itself; give the golden '
        "a file of its own",
    )
    assert own.read_text() == text

    # An ONNX model saved as JSON, named as the golden of itself.
    model = onnx.load(FIXTURES / "attention.onnx")
    (tmp_path / "model.json").write_bytes(model.SerializeToString())
    as_json = tmp_path / "shardcheck.toml"
    as_json.write_text(
        "[tool.shardcheck]\n[[tool.shardcheck.models]]\n"
        'path = "model.json"\ngolden = "model.json"\n'
    )
    before = (tmp_path / "model.json").read_bytes()
    one_error_line(
        run_cli("check", "--manifest", as_json, "--update"),
        '"model.json" is the model of tool.shardcheck.models[0]; give the golden a file of its own',
    )
    assert (tmp_path / "model.json").read_bytes() == before


def test_an_existing_file_that_is_not_a_hints_file_is_never_overwritten(tmp_path: Path) -> None:
    manifest = project(tmp_path, "settings.json")
    (tmp_path / "settings.json").write_text(SETTINGS)

    result = run_cli("check", "--manifest", manifest, "--update")

    assert result.exit_code == 1
    assert result.stdout.splitlines()[0].startswith("INVALID  attention (")
    assert "not a hints file, so never overwritten" in result.stdout
    assert (tmp_path / "settings.json").read_text() == SETTINGS


@pytest.mark.parametrize(
    "broken",
    ['{"parallelism": "CP"', "", '<<<<<<< HEAD\n{"a": 1}\n=======\n{"a": 2}\n>>>>>>> b\n'],
    ids=["cut short", "empty", "merge conflict"],
)
def test_a_broken_golden_is_still_rewritten_by_update(tmp_path: Path, broken: str) -> None:
    manifest = project(tmp_path)
    (tmp_path / "golden").mkdir()
    golden = tmp_path / "golden" / "attention.json"
    golden.write_text(broken)

    result = run_cli("check", "--manifest", manifest, "--update")

    assert result.exit_code == 0, result.stdout
    expected = generate(load_index(FIXTURES / "attention.onnx"), GenOptions()).hints
    assert golden.read_text() == dumps(expected)


@pytest.mark.parametrize("option", [(), ("--update",)])
def test_a_fifo_as_the_golden_neither_blocks_nor_is_replaced(
    tmp_path: Path, option: tuple[str, ...]
) -> None:
    manifest = project(tmp_path)
    (tmp_path / "golden").mkdir()
    fifo = tmp_path / "golden" / "attention.json"
    os.mkfifo(fifo)

    result = run_cli("check", "--manifest", manifest, *option)  # would block if it opened it

    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == (
        f"INVALID  attention ({fifo}: is a FIFO, not a regular file: remove it, or give the "
        "model another golden path)"
    )
    assert fifo.is_fifo()


def test_a_golden_linked_to_a_device_is_not_reported_updated(tmp_path: Path) -> None:
    # /dev/null is outside the project: the manifest refuses the link outright.
    manifest = project(tmp_path)
    (tmp_path / "golden").mkdir()
    (tmp_path / "golden" / "attention.json").symlink_to("/dev/null")

    result = run_cli("check", "--manifest", manifest, "--update")

    one_error_line(result, "give a path inside it")
    assert "UPDATED" not in result.stdout


def test_a_device_inside_the_project_is_not_reported_updated(tmp_path: Path) -> None:
    # What a device inside the project looks like to the gate (mknod needs root): the
    # comparison is told by the file's type, so a FIFO stands for it.
    from shardcheck.gating.gate import INVALID, compare_with_golden

    fifo = tmp_path / "device.json"
    os.mkfifo(fifo)
    hints = generate(load_index(FIXTURES / "attention.onnx"), GenOptions()).hints
    comparison = compare_with_golden(hints, fifo, update=True)
    assert (comparison.status, comparison.replaceable) == (INVALID, False)


def test_report_naming_a_weight_file_of_a_model_is_refused(tmp_path: Path) -> None:
    model = onnx.load(FIXTURES / "attention_head.onnx")  # has initializers
    (tmp_path / "fixtures").mkdir()
    onnx.save(
        model,
        tmp_path / "fixtures" / "attention_head.onnx",
        save_as_external_data=True,
        location="W.bin",
        size_threshold=0,
    )
    manifest = tmp_path / "shardcheck.toml"
    manifest.write_text(
        "[tool.shardcheck]\n[[tool.shardcheck.models]]\n"
        'path = "fixtures/attention_head.onnx"\ngolden = "golden/attention_head.json"\n'
    )
    weights = (tmp_path / "fixtures" / "W.bin").read_bytes()

    result = run_cli(
        "check", "--manifest", manifest, "--update", "--report", tmp_path / "fixtures" / "W.bin"
    )

    one_error_line(
        result, "is a weight file of the model of attention_head; write the report elsewhere"
    )
    assert (tmp_path / "fixtures" / "W.bin").read_bytes() == weights
    assert not (tmp_path / "golden").exists()  # nothing ran


def test_a_report_that_cannot_be_written_stops_the_run_before_any_golden(tmp_path: Path) -> None:
    manifest = project(tmp_path)

    # /proc takes no new files: the report cannot be written there, by root either.
    result = run_cli("check", "--manifest", manifest, "--update", "--report", "/proc/report.json")

    assert result.exit_code == 2
    assert result.stderr.startswith("shardcheck: error: /proc/report.json: cannot write: ")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "golden").exists()


MANIFEST_CASES = {
    "NUL in a golden": (
        '[tool.shardcheck]\n[[tool.shardcheck.models]]\npath = "fixtures/attention.onnx"\n'
        'golden = "golden/a\\u0000b.json"\n',
        'tool.shardcheck.models[0].golden: "golden/a\\u0000b.json": a path cannot hold a NUL byte',
    ),
    "NUL in a model path": (
        '[tool.shardcheck]\n[[tool.shardcheck.models]]\npath = "fixtures/a\\u0000.onnx"\n'
        'golden = "golden/a.json"\n',
        "a path cannot hold a NUL byte",
    ),
    "300-character golden": (
        '[tool.shardcheck]\n[[tool.shardcheck.models]]\npath = "fixtures/attention.onnx"\n'
        f'golden = "golden/{"g" * 295}.json"\n',
        "a file name in it is longer than 255 bytes",
    ),
    "a golden too long for its temporary file": (
        '[tool.shardcheck]\n[[tool.shardcheck.models]]\npath = "fixtures/attention.onnx"\n'
        f'golden = "golden/{"g" * 245}.json"\n',
        "the file name is longer than 240 bytes; give a shorter one",
    ),
    "nested 100,000 levels deep": (
        "[tool.shardcheck]\nmodels = " + "[" * 100_000 + "]" * 100_000 + "\n",
        "not a usable TOML file: nested too deeply",
    ),
    "a byte-order mark": (
        "\ufeff[tool.shardcheck]\n",
        "begins with a UTF-8 byte-order mark, which TOML does not allow; save the file without it",
    ),
    "a timeout that is no number": (
        '[tool.shardcheck]\ntimeout = "soon"\n[[tool.shardcheck.models]]\n'
        'path = "fixtures/attention.onnx"\ngolden = "golden/a.json"\n',
        'tool.shardcheck.timeout: expected a positive number of seconds, got "soon"',
    ),
    "a strict that is no boolean": (
        '[tool.shardcheck]\n[[tool.shardcheck.models]]\npath = "fixtures/attention.onnx"\n'
        'golden = "golden/a.json"\nstrict = 1\n',
        "tool.shardcheck.models[0].strict: expected true or false, got 1",
    ),
}


@pytest.mark.parametrize("text, expected_end", MANIFEST_CASES.values(), ids=MANIFEST_CASES)
def test_a_bad_manifest_is_one_line_and_exit_2(
    tmp_path: Path, text: str, expected_end: str
) -> None:
    project(tmp_path)
    manifest = tmp_path / "shardcheck.toml"
    manifest.write_text(text, encoding="utf-8")

    for options in ((), ("--update",)):
        result = run_cli("check", "--manifest", manifest, *options)
        one_error_line(result, expected_end)
    assert not (tmp_path / "golden").exists()


def test_a_nul_in_the_manifest_option_is_one_line() -> None:
    one_error_line(run_cli("check", "--manifest", "a\0b.toml"), "a path cannot hold a NUL byte")


def test_standard_input_as_the_manifest_is_called_a_stream(tmp_path: Path) -> None:
    result = run_cli("check", "--manifest", "/dev/stdin")
    one_error_line(
        result, "is standard input or another open stream, not a file; give the manifest's path"
    )
    fifo = tmp_path / "manifest.toml"
    os.mkfifo(fifo)
    one_error_line(
        run_cli("check", "--manifest", fifo),
        "is not a regular file (a pipe or a device); give the manifest's path",
    )


@pytest.mark.parametrize("text, expected_end", MANIFEST_CASES.values(), ids=MANIFEST_CASES)
def test_a_bad_manifest_is_a_clean_failure_under_the_plugin(
    pytester: pytest.Pytester, text: str, expected_end: str
) -> None:
    project(pytester.path)
    (pytester.path / "shardcheck.toml").write_text(text, encoding="utf-8")

    result = pytester.runpytest("-p", "no:cacheprovider", "--shardcheck")

    assert result.ret != 0
    output = result.stdout.str()
    assert "Traceback" not in output and "internal error" not in output
    assert expected_end in output
    assert not (pytester.path / "golden").exists()
