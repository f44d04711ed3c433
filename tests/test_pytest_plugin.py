"""The pytest plugin, driven through ``pytester``: manifest items and the regression fixture."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FIXTURES, LONG_LENGTH, long_matmul_model

# Imported here, outside pytester's runs: each in-process run drops the modules it imported,
# and deepdiff's cachebox (a PyO3 extension, under the gate's hints diff) cannot be loaded twice.
import shardcheck.gating.gate  # noqa: F401
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.loader import load_index
from shardcheck.hints.codec import dumps
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints

MODELS = ("attention", "attention_head", "multi_attention")
CREATED = (
    "(there was no golden: review it, then rerun to compare against it; --shardcheck-update "
    "writes goldens without failing)"
)


def generated_hints(name: str, **options: object) -> ShardHints:
    return generate(load_index(FIXTURES / f"{name}.onnx"), GenOptions(**options)).hints  # type: ignore[arg-type]


def with_reduce_op(hints: ShardHints, reduce_op: str) -> ShardHints:
    return hints.with_changes(dist_collectives=replace(hints.dist_collectives, reduce_op=reduce_op))


def make_project(
    directory: Path,
    models: tuple[str, ...] = MODELS,
    *,
    verify: tuple[str, ...] = (),
    manifest_name: str = "shardcheck.toml",
) -> Path:
    """Fixture models with up-to-date goldens in ``directory`` and a manifest listing them."""
    (directory / "fixtures").mkdir()
    (directory / "golden").mkdir()
    lines = ["[tool.shardcheck]", 'golden-dir = "golden"']
    for name in models:
        shutil.copy(FIXTURES / f"{name}.onnx", directory / "fixtures")
        (directory / "golden" / f"{name}.json").write_text(dumps(generated_hints(name)))
        lines += [
            "[[tool.shardcheck.models]]",
            f'path = "fixtures/{name}.onnx"',
            f'golden = "golden/{name}.json"',
            f"verify = {'true' if name in verify else 'false'}",
        ]
    manifest = directory / manifest_name
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def drift(golden: Path) -> None:
    golden.write_text(dumps(with_reduce_op(read_hints(golden), "sum")))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # hypothesis' plugin imports all of hypothesis at the end of each in-process run: slow.
    return pytester.runpytest("-p", "no:hypothesispytest", *args)


def collected(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if "::" in line]


def test_one_item_per_model_and_check(pytester: pytest.Pytester) -> None:
    make_project(pytester.path, verify=("attention_head",))

    result = run(pytester, "--shardcheck", "--collect-only", "-q")

    assert collected(result) == [
        "shardcheck.toml::attention::gen",
        "shardcheck.toml::attention_head::gen",
        "shardcheck.toml::attention_head::verify",
        "shardcheck.toml::multi_attention::gen",
        "shardcheck.toml::[stale goldens]",
    ]


def test_nothing_is_collected_without_the_option(pytester: pytest.Pytester) -> None:
    make_project(pytester.path)

    result = run(pytester, "--collect-only", "-q")

    assert collected(result) == []
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_manifest_in_pyproject_next_to_tests(pytester: pytest.Pytester) -> None:
    make_project(pytester.path, ("attention",), manifest_name="pyproject.toml")
    with (pytester.path / "pyproject.toml").open("a") as stream:
        stream.write('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    pytester.mkpydir("tests")
    (pytester.path / "tests" / "test_unit.py").write_text("def test_unit():\n    pass\n")

    default = run(pytester, "--shardcheck", "--collect-only", "-q")
    # testpaths does not hold the manifest: it is collected as well.
    assert collected(default) == [
        "tests/test_unit.py::test_unit",
        "pyproject.toml::attention::gen",
        "pyproject.toml::[stale goldens]",
    ]
    # Naming a test file runs that file only.
    explicit = run(pytester, "--shardcheck", "--collect-only", "-q", "tests/test_unit.py")
    assert collected(explicit) == ["tests/test_unit.py::test_unit"]


def test_all_match_passes(pytester: pytest.Pytester) -> None:
    make_project(pytester.path)

    result = run(pytester, "--shardcheck")

    result.assert_outcomes(passed=4)


def test_drifted_model_fails_with_the_semantic_diff(pytester: pytest.Pytester) -> None:
    make_project(pytester.path)
    drift(pytester.path / "golden" / "attention_head.json")

    result = run(pytester, "--shardcheck")

    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ attention_head::gen _*",
            "DIFFERS  attention_head (1 difference)",
            '    dist_collectives.reduce_op: "sum" -> "max"',
            "FAILED shardcheck.toml::attention_head::gen*",
        ]
    )
    output = result.stdout.str()
    assert "Traceback" not in output
    assert "polygraphy_class" not in output  # no JSON dump
    assert "runtest" not in output


def test_update_option_fixes_the_drifted_golden(pytester: pytest.Pytester) -> None:
    make_project(pytester.path)
    golden = pytester.path / "golden" / "attention_head.json"
    expected = golden.read_text()
    drift(golden)
    untouched = (pytester.path / "golden" / "attention.json").stat().st_mtime_ns

    updated = run(pytester, "--shardcheck", "--shardcheck-update")

    updated.assert_outcomes(passed=4)
    updated.stdout.fnmatch_lines(["*shardcheck*", "updated golden/attention_head.json"])
    assert golden.read_text() == expected
    assert (pytester.path / "golden" / "attention.json").stat().st_mtime_ns == untouched
    run(pytester, "--shardcheck").assert_outcomes(passed=4)


def test_missing_golden_and_broken_model_fail_without_traceback(pytester: pytest.Pytester) -> None:
    make_project(pytester.path)
    golden = pytester.path / "golden" / "attention.json"
    expected = golden.read_text()
    golden.unlink()
    (pytester.path / "fixtures" / "multi_attention.onnx").write_bytes(b"")

    result = run(pytester, "--shardcheck")

    # A missing golden is written and its item fails naming the file, as the fixture does.
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            f"created: golden/attention.json {CREATED}",
            "ERROR    multi_attention: */fixtures/multi_attention.onnx: empty file, expected an "
            "ONNX model",
        ]
    )
    assert "Traceback" not in result.stdout.str()
    assert golden.read_text() == expected
    run(pytester, "--shardcheck", "-k", "attention and not multi").assert_outcomes(
        passed=2, deselected=2
    )


def test_stale_golden_item(pytester: pytest.Pytester) -> None:
    make_project(pytester.path, ("attention",))
    (pytester.path / "golden" / "old.json").write_text(dumps(generated_hints("attention")))
    (pytester.path / "golden" / "notes.json").write_text("{}")

    result = run(pytester, "--shardcheck")

    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "goldens that no model in the manifest claims (delete them, list their models, or run "
            "with --shardcheck-update):",
            "    golden/notes.json",
            "    golden/old.json",
        ]
    )

    # The update removes the stale hints golden, never a JSON file that is not one.
    updated = run(pytester, "--shardcheck", "--shardcheck-update")
    updated.assert_outcomes(passed=1, failed=1)
    updated.stdout.fnmatch_lines(["*= shardcheck =*", "removed golden/old.json"])
    assert not (pytester.path / "golden" / "old.json").exists()
    assert (pytester.path / "golden" / "notes.json").read_text() == "{}"


def test_invalid_manifest_is_a_one_line_collection_error(pytester: pytest.Pytester) -> None:
    manifest = make_project(pytester.path, ("attention",))
    manifest.write_text(manifest.read_text().replace("verify = false", "verify = 0"))

    result = run(pytester, "--shardcheck")

    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "*ERROR collecting shardcheck.toml*",
            "shardcheck.toml: tool.shardcheck.models[0].verify: expected true or false, got 0",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_explicit_manifest_option(pytester: pytest.Pytester) -> None:
    (pytester.path / "sub").mkdir()
    make_project(pytester.path / "sub")

    result = run(
        pytester,
        "--shardcheck",
        "--shardcheck-manifest",
        "sub/shardcheck.toml",
        "--collect-only",
        "-q",
    )

    assert collected(result)[:1] == ["sub/shardcheck.toml::attention::gen"]
    missing = run(pytester, "--shardcheck", "--shardcheck-manifest", "nope.toml")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*--shardcheck-manifest: nope.toml: no such file*"])
    directory = run(pytester, "--shardcheck", "--shardcheck-manifest", "sub")
    assert directory.ret == pytest.ExitCode.USAGE_ERROR
    directory.stderr.fnmatch_lines(
        ["*--shardcheck-manifest: sub: is a directory, expected a TOML file*"]
    )


def test_verify_item_without_verify_module_fails_cleanly(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "shardcheck.verification.verify", None)  # import now fails
    make_project(pytester.path, ("attention",), verify=("attention",))

    result = run(pytester, "--shardcheck", "-k", "verify")

    result.assert_outcomes(failed=1, deselected=2)
    result.stdout.fnmatch_lines(
        ["*_ attention::verify _*", "verify is not available in this version"]
    )


# ------------------------------------------------------------- shard_hints_regression fixture

REGRESSION_TEST = """
from pathlib import Path

MODEL = Path({model!r})


def test_head(shard_hints_regression):
    hints = shard_hints_regression.check(MODEL)
    assert hints.attention_layers


def test_fused(shard_hints_regression):
    # Polygraphy's mode: the default mode keeps this rank-3 layer native (no heads axis).
    shard_hints_regression.check(
        MODEL, basename="fused_head", cp_type="fused", groups=[0, 1], compat="polygraphy"
    )
"""


def write_regression_test(pytester: pytest.Pytester) -> Path:
    model = pytester.path / "attention_head.onnx"
    shutil.copy(FIXTURES / "attention_head.onnx", model)
    pytester.makepyfile(test_models=REGRESSION_TEST.format(model=str(model)))
    return pytester.path / "test_models"


def test_regression_fixture_creates_then_passes(pytester: pytest.Pytester) -> None:
    goldens = write_regression_test(pytester)

    first = run(
        pytester,
    )

    first.assert_outcomes(failed=2)
    first.stdout.fnmatch_lines(
        [
            f"created: test_models/test_head.json {CREATED}",
            f"created: test_models/fused_head.json {CREATED}",
        ]
    )
    # The terminal summary lists each golden written, the fixture's too.
    first.stdout.fnmatch_lines(
        [
            "*= shardcheck =*",
            "created test_models/test_head.json",
            "created test_models/fused_head.json",
        ]
    )
    assert read_hints(goldens / "test_head.json") == generated_hints("attention_head")
    fused = json.loads((goldens / "fused_head.json").read_text())
    assert fused["dist_collectives"]["groups"] == [0, 1]
    assert fused["attention_layers"][0]["replace"]["polygraphy_class"] == "FusedAttention"

    run(
        pytester,
    ).assert_outcomes(passed=2)


def test_regression_fixture_shows_differences_and_update_rewrites(
    pytester: pytest.Pytester,
) -> None:
    goldens = write_regression_test(pytester)
    run(
        pytester,
    )
    golden = goldens / "test_head.json"
    drift(golden)

    differs = run(pytester, "-k", "head and not fused")

    differs.assert_outcomes(failed=1, deselected=1)
    differs.stdout.fnmatch_lines(
        [
            "test_models/test_head.json: the hints differ from the golden (1 difference; run with "
            "--shardcheck-update to accept them)",
            '    dist_collectives.reduce_op: "sum" -> "max"',
        ]
    )
    assert "Traceback" not in differs.stdout.str()

    # The update rewrites the golden and the test passes, as a manifest item does.
    fused = (goldens / "fused_head.json").stat().st_mtime_ns
    updated = run(pytester, "--shardcheck-update")
    updated.assert_outcomes(passed=2)
    updated.stdout.fnmatch_lines(["*= shardcheck =*", "updated test_models/test_head.json"])
    assert (goldens / "fused_head.json").stat().st_mtime_ns == fused  # it matched: untouched
    assert read_hints(golden) == generated_hints("attention_head")
    run(
        pytester,
    ).assert_outcomes(passed=2)


def test_regression_fixture_bad_option_is_a_clean_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_bad(shard_hints_regression):
            shard_hints_regression.check("m.onnx", cp_type=3)
        """
    )

    # -rN: without the short summary, which repeats the message only when the terminal is wide.
    result = run(pytester, "-rN")

    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*shard_hints_regression.check: gen option 'cp_type': expected a string, got 3"]
    )
    # Said once: no "During handling of the above exception" and the message again.
    assert result.stdout.str().count("expected a string, got 3") == 1
    assert "During handling" not in result.stdout.str()


def test_two_tests_whose_names_map_to_one_golden_are_told_apart(
    pytester: pytest.Pytester,
) -> None:
    shutil.copy(FIXTURES / "attention_head.onnx", pytester.path / "m.onnx")
    pytester.makepyfile(
        test_h="""
        import pytest

        @pytest.mark.parametrize("x", ["a-b", "a_b"])
        def test_param(shard_hints_regression, x):
            shard_hints_regression.check("m.onnx")
        """
    )

    result = run(pytester, "-p", "no:randomly")

    # The first creates test_h/test_param_a_b_.json; the second may not take it as its own.
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*created: test_h/test_param_a_b_.json*",
            "*test_h/test_param_a_b_.json is the golden of test_h.py::test_param[[]a-b[]] too; "
            "give one of the tests its own with check(..., basename=...)*",
        ]
    )


def test_tests_that_name_one_golden_on_purpose_share_it(pytester: pytest.Pytester) -> None:
    # An option that must not change the hints, checked against one golden by basename.
    shutil.copy(FIXTURES / "attention_head.onnx", pytester.path / "m.onnx")
    pytester.makepyfile(
        test_h="""
        import pytest

        @pytest.mark.parametrize("opts", [{}, {"reduce_op": "max"}])
        def test_same(shard_hints_regression, opts):
            shard_hints_regression.check("m.onnx", basename="head", **opts)
        """
    )
    run(pytester).assert_outcomes(passed=1, failed=1)  # the first run creates the golden
    run(pytester).assert_outcomes(passed=2)


def test_a_verify_item_past_its_timeout_is_a_clean_failure(pytester: pytest.Pytester) -> None:
    # At LONG_LENGTH the one MatMul runs for many seconds, far past the manifest's timeout of
    # 1 s (a shorter run could end before its bound is checked).
    long_matmul_model(pytester.path / "long.onnx")
    (pytester.path / "long.json").write_text(
        dumps(generate(load_index(pytester.path / "long.onnx"), GenOptions()).hints)
    )
    (pytester.path / "shardcheck.toml").write_text(
        "[tool.shardcheck]\ntimeout = 1\n[[tool.shardcheck.models]]\n"
        'path = "long.onnx"\ngolden = "long.json"\nverify = true\n'
        f"seq-lens = [8, {LONG_LENGTH}]\n"
    )

    result = run(pytester, "--shardcheck", "-k", "verify")

    result.assert_outcomes(failed=1, deselected=1)
    output = result.stdout.str()
    assert "did not finish within --timeout 1.0 s" in output
    assert "its process was stopped" in output and "Traceback" not in output
