"""The simulation's tolerances follow the outputs' element type: fp16 exports pass verify with its
defaults, and check --verify gates them, with a manifest's own rtol/atol when it gives them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, GOLDEN, run_cli, simulated_lengths
from onnx import TensorProto

from shardcheck.gating.gate import run_check
from shardcheck.gating.manifest import load_manifest
from shardcheck.runtime.settings import default_tolerances
from shardcheck.verification.verify import verify

REAL = FIXTURES / "real"
FP16 = ["dynamo_gpt2_tiny_fp16", "ts_llama_tiny_gqa_fp16"]


@pytest.mark.parametrize(
    ("types", "expected"),
    [
        ([TensorProto.FLOAT], (1e-4, 1e-5)),
        ([TensorProto.FLOAT16], (1e-2, 1e-3)),
        ([TensorProto.BFLOAT16], (8e-2, 8e-3)),
        ([TensorProto.DOUBLE], (1e-9, 1e-10)),
        # The coarsest floating output decides; integer or unknown outputs do not count.
        ([TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64], (1e-2, 1e-3)),
        ([TensorProto.INT64, None], (1e-4, 1e-5)),
        ([], (1e-4, 1e-5)),
    ],
)
def test_default_tolerances_by_the_outputs_element_type(
    types: list[int | None], expected: tuple[float, float]
) -> None:
    assert default_tolerances(types) == expected


@pytest.mark.parametrize("name", FP16)
def test_an_fp16_export_passes_verify_with_its_defaults_and_not_with_float32s(name: str) -> None:
    model, hints = REAL / f"{name}.onnx", GOLDEN / "real" / f"{name}.json"
    report = verify(model, hints)
    assert report.ok, report.render_text()
    assert simulated_lengths(report) == [(8, True), (16, True)]
    # float32's tolerances are finer than fp16's own rounding: the split run "differs".
    strict = verify(model, hints, rtol=1e-4, atol=1e-5)
    assert [f.code for f in strict.errors] == ["SC201"], strict.render_text()
    assert "rtol 0.0001, atol 1e-05" in strict.errors[0].message


@pytest.mark.parametrize("name", FP16)
def test_an_fp16_export_passes_verify_at_4_ranks_too(name: str) -> None:
    result = run_cli(
        "verify", REAL / f"{name}.onnx", GOLDEN / "real" / f"{name}.json", "--ranks", "4", "-q"
    )
    assert result.exit_code == 0, result.stdout


def test_check_verify_gates_fp16_exports_with_the_manifests_tolerances(tmp_path: Path) -> None:
    entries = []
    for name in FP16:
        shutil.copy(REAL / f"{name}.onnx", tmp_path)
        # The golden and what check keeps beside it (the extension's file, the plan).
        for golden in (GOLDEN / "real").glob(f"{name}.*"):
            shutil.copy(golden, tmp_path)
        entries.append(
            f'[[tool.shardcheck.models]]\npath = "{name}.onnx"\ngolden = "{name}.json"\n'
            "verify = true\n"
        )
    manifest = tmp_path / "shardcheck.toml"
    manifest.write_text("\n".join(entries))
    by_default = run_check(load_manifest(manifest), verify=True)
    statuses = [(r.entry.name, r.status) for r in by_default.models]
    assert statuses == [(n, "ok") for n in FP16], by_default.lines()
    # Tolerances of 0 demand bit-equal results, which a split fp16 run does not give.
    manifest.write_text("\n".join(entry + "rtol = 0\natol = 0\n" for entry in entries))
    exact = run_check(load_manifest(manifest), verify=True)
    assert [(r.entry.name, r.status) for r in exact.models] == [(n, "failed") for n in FP16]


def test_simulate_takes_the_same_defaults_by_type() -> None:
    from shardcheck.simulation.simulate import simulate

    name = "ts_llama_tiny_gqa_fp16"
    result = simulate(REAL / f"{name}.onnx", GOLDEN / "real" / f"{name}.json", ranks=2, seq_len=8)
    assert result.ok, result.summary()
    assert (result.rtol, result.atol) == (1e-2, 1e-3)
