"""The plugin's goldens the same way in both front ends, stale fixture goldens, and
pytest-xdist: the same outcomes, goldens written and removed, and stale reports as a serial run."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES
from test_pytest_plugin import drift, generated_hints, make_project

from shardcheck.hints.codec import dumps

REGRESSION_TESTS = """
import pytest

MODEL = {model!r}


def test_head(shard_hints_regression):
    shard_hints_regression.check(MODEL)


@pytest.mark.parametrize("reduce_op", ["sum", "max"])
def test_ops(shard_hints_regression, reduce_op):
    shard_hints_regression.check(MODEL, reduce_op=reduce_op)


def test_plain():
    assert True
"""


def fixture_project(directory: Path) -> Path:
    """A manifest project (one drifted golden, one missing, one stale) and a test file using
    the fixture (its golden directory: one golden up to date, one missing, one stale)."""
    make_project(directory)
    drift(directory / "golden" / "attention_head.json")
    (directory / "golden" / "multi_attention.json").unlink()
    (directory / "golden" / "old.json").write_text(dumps(generated_hints("attention")))
    model = directory / "attention_head.onnx"
    shutil.copy(FIXTURES / "attention_head.onnx", model)
    (directory / "test_models.py").write_text(REGRESSION_TESTS.format(model=str(model)))
    goldens = directory / "test_models"
    goldens.mkdir()
    (goldens / "test_head.json").write_text(dumps(generated_hints("attention_head")))
    (goldens / "test_gone.json").write_text(dumps(generated_hints("attention_head")))
    return goldens


def files(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*.json"))
    }


def shardcheck_section(result: pytest.RunResult) -> list[str]:
    """The lines of the terminal summary's shardcheck section, sorted (workers finish in any
    order)."""
    lines = result.outlines
    start = next((i for i, line in enumerate(lines) if re.match(r"^=+ shardcheck =+$", line)), None)
    if start is None:
        return []
    section = []
    for line in lines[start + 1 :]:
        if line.startswith("="):
            break
        if line:
            section.append(line)
    return sorted(section)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_a_stale_fixture_golden_fails_the_session_and_the_update_removes_it(
    pytester: pytest.Pytester,
) -> None:
    goldens = fixture_project(pytester.path)

    first = run(pytester, "test_models.py", "-k", "not test_head")
    # A missing golden is written and its test fails; deselecting a test of the file that uses
    # the fixture leaves its goldens alone (unknown what it asks for): none is called stale.
    first.assert_outcomes(passed=1, failed=2, deselected=1)
    assert shardcheck_section(first) == [
        "created test_models/test_ops_max_.json",
        "created test_models/test_ops_sum_.json",
    ]

    whole = run(pytester, "test_models.py")
    whole.assert_outcomes(passed=4)
    assert whole.ret == pytest.ExitCode.TESTS_FAILED  # the stale golden fails the session
    assert shardcheck_section(whole) == [
        "stale golden: test_models/test_gone.json (no test asked for it; delete it, or run with "
        "--shardcheck-update to remove it)",
    ]

    updated = run(pytester, "test_models.py", "--shardcheck-update")
    assert updated.ret == pytest.ExitCode.OK
    assert shardcheck_section(updated) == ["removed test_models/test_gone.json"]
    assert not (goldens / "test_gone.json").exists()
    assert (goldens / "test_head.json").exists()
    assert run(pytester, "test_models.py").ret == pytest.ExitCode.OK


@pytest.mark.parametrize("update", [False, True], ids=["check", "update"])
def test_xdist_gives_the_results_of_a_serial_run(pytester: pytest.Pytester, update: bool) -> None:
    pytest.importorskip("xdist")
    serial_dir = pytester.path / "serial"
    spread_dir = pytester.path / "spread"
    for directory in (serial_dir, spread_dir):
        directory.mkdir()
        fixture_project(directory)
    option = ("--shardcheck-update",) if update else ()

    pytester.chdir()
    runs = [
        run(pytester, "--shardcheck", "--rootdir", str(directory), str(directory), *extra, *option)
        for directory, extra in ((serial_dir, ()), (spread_dir, ("-n", "2", "-v")))
    ]
    serial, spread = runs

    assert spread.parseoutcomes() == serial.parseoutcomes()
    assert spread.ret == serial.ret
    assert serial.ret == (pytest.ExitCode.OK if update else pytest.ExitCode.TESTS_FAILED)
    assert shardcheck_section(spread) == shardcheck_section(serial)
    assert files(spread_dir) == files(serial_dir)
    # The items were spread: both workers ran some.
    output = spread.stdout.str()
    assert "[gw0]" in output and "[gw1]" in output
    if update:
        assert shardcheck_section(serial) == [
            "created golden/multi_attention.json",
            "created test_models/test_ops_max_.json",
            "created test_models/test_ops_sum_.json",
            "removed golden/old.json",
            "removed test_models/test_gone.json",
            "updated golden/attention_head.json",
        ]
    else:
        assert "stale golden: test_models/test_gone.json" in shardcheck_section(serial)[-1]


def test_a_basename_with_a_directory_is_refused(pytester: pytest.Pytester) -> None:
    model = pytester.path / "attention_head.onnx"
    shutil.copy(FIXTURES / "attention_head.onnx", model)
    pytester.makepyfile(
        test_escape=f"""
        def test_up(shard_hints_regression):
            shard_hints_regression.check({str(model)!r}, basename="../outside")
        """
    )

    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*check(basename='../outside'): expected a file name without a directory*"]
    )
    assert not (pytester.path / "outside.json").exists()
    assert not list(pytester.path.rglob("*.json"))
