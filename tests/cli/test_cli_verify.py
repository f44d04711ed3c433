"""verify's command line: repeated findings collapsed, --ignore, --strict, -q, JSON nulls."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, GOLDEN, benchmark_models, run_cli

GPT2 = FIXTURES / "real" / "ts_gpt2_tiny.onnx"
# Its golden hints: verify warns twice of them, SC110 (both layers match neither of
# Polygraphy's patterns), and finds no error.
GPT2_HINTS = GOLDEN / "real" / "ts_gpt2_tiny.json"


@pytest.fixture(scope="module")
def deep_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The benchmark's 96-layer encoder (small widths) and its hints from gen."""
    builder = benchmark_models()
    directory = tmp_path_factory.mktemp("deep")
    model, hints = directory / "export96.onnx", directory / "export96.json"
    config = builder.EncoderConfig(depth=96, kind="export", hidden=16, heads=2, ffn=32)
    onnx.save(builder.build_encoder(config), model)
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    return model, hints


def _repeats(text: str) -> Counter[str]:
    """How often each line occurs once the numbers in it (a layer's index) are blanked."""
    return Counter(re.sub(r"\d+", "N", line) for line in text.splitlines() if line.strip())


def test_a_96_layer_model_repeats_no_line_of_verify_more_than_3_times(
    deep_encoder: tuple[Path, Path],
) -> None:
    model, hints = deep_encoder
    result = run_cli("verify", model, hints, "--ranks", "2")
    assert result.exit_code == 0, result.stdout + result.stderr
    # Every layer is one Polygraphy's patterns do not match: 96 SC110 findings, told once.
    assert "PASS: 0 error(s), 96 warning(s)" in result.stdout
    sc110 = [line for line in result.stdout.splitlines() if line.startswith("SC110")]
    assert len(sc110) == 2, result.stdout  # the table's row and the message
    assert "(+95 more)" in sc110[0]
    assert sc110[1].startswith("SC110 warning: 96 findings, at ")
    assert "layer.0/" in sc110[1] and "layer.2/" in sc110[1] and "93 more" in sc110[1]
    most = _repeats(result.stdout + result.stderr).most_common(1)[0]
    assert most[1] <= 3, most
    # The JSON keeps every one.
    document = json.loads(run_cli("verify", model, hints, "--format", "json").stdout)
    assert sum(f["code"] == "SC110" for f in document["findings"]) == 96


def test_a_few_findings_of_one_code_are_shown_one_by_one() -> None:
    result = run_cli("verify", GPT2, GPT2_HINTS)
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("SC110  ")]
    assert [row.split()[-1] for row in rows] == [
        "attention_layers[q=/model/h.0/attn/Mul_output_0]",
        "attention_layers[q=/model/h.1/attn/Mul_output_0]",
    ]


def test_strict_fails_on_warnings_and_ignore_leaves_a_code_out() -> None:
    strict = run_cli("verify", GPT2, GPT2_HINTS, "--strict")
    assert strict.exit_code == 1, strict.stdout
    assert strict.stdout.endswith("FAIL: 0 error(s), 2 warning(s) (--strict: warnings fail)\n")
    # Without the two SC110s nothing is left to fail.
    ignored = run_cli("verify", GPT2, GPT2_HINTS, "--strict", "--ignore", "SC110")
    assert ignored.exit_code == 0, ignored.stdout
    assert "SC110" not in ignored.stdout.replace("ignored: SC110", "")
    assert ignored.stdout.endswith(
        "PASS: 0 error(s), 0 warning(s) (ignored: SC110; --strict: warnings fail)\n"
    )
    document = json.loads(
        run_cli("verify", GPT2, GPT2_HINTS, "--strict", "--format", "json").stdout
    )
    assert (document["ok"], document["strict"], document["ignored"]) == (False, True, [])


def test_ignore_refuses_a_code_that_does_not_exist() -> None:
    result = run_cli("verify", GPT2, GPT2_HINTS, "--ignore", "SC999")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "'SC999' is not a finding code" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_quiet_shows_only_what_fails() -> None:
    quiet = run_cli("verify", GPT2, GPT2_HINTS, "-q")
    assert quiet.exit_code == 0
    assert quiet.stdout.splitlines() == [
        f"verify {GPT2} with {GPT2_HINTS}",
        "PASS: 0 error(s), 2 warning(s)",
    ]
    assert quiet.stderr == ""
    # Under --strict the warnings fail: they are shown.
    strict = run_cli("verify", GPT2, GPT2_HINTS, "-q", "--strict")
    assert strict.exit_code == 1
    assert sum(line.startswith("SC110") for line in strict.stdout.splitlines()) == 4


def test_json_writes_null_where_a_finding_has_no_value() -> None:
    document = json.loads(run_cli("verify", GPT2, GPT2_HINTS, "--format", "json").stdout)
    sc110 = [f for f in document["findings"] if f["code"] == "SC110"]
    # SC110 names a layer's Q: no value is expected or observed.
    assert sc110 and all(f["expected"] is None and f["observed"] is None for f in sc110)
    assert all(f["tensor"] for f in sc110)
    assert "" not in [value for f in document["findings"] for value in f.values()]
