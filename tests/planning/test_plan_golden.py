"""check records each model's plan beside its golden and fails a plan that splits less."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURES, one_model_manifest, run_cli

from shardcheck.hints.files import read_hints

REAL = FIXTURES / "real"


def _project(tmp_path: Path, model: Path, gen: str = "") -> Path:
    return one_model_manifest(tmp_path, model, gen)


def test_update_records_the_plan_beside_the_golden(tmp_path: Path) -> None:
    manifest = _project(tmp_path, FIXTURES / "attention_head.onnx")
    created = run_cli("check", "--manifest", manifest, "--update")
    assert created.exit_code == 0, created.stdout + created.stderr
    sidecar = tmp_path / "golden" / "model.plan"
    # Every FLOP of attention_head runs on slices (tests/planning/test_plan_figures.py).
    assert json.loads(sidecar.read_text()) == {
        "seq_len": 4096,
        "ranks": 2,
        "flops_on_slices": 1.0,
    }
    # The hints golden is a plain hints file still, and the sidecar is no stale golden.
    read_hints(tmp_path / "golden" / "model.json")
    again = run_cli("check", "--manifest", manifest)
    assert again.exit_code == 0, again.stdout
    assert "STALE" not in again.stdout


def test_a_plan_below_its_golden_fails_with_the_figures(tmp_path: Path) -> None:
    # The Polygraphy-format hints alone (gen's default plan for this model is the extension,
    # which splits everything: tests/gating/test_extension_golden.py).
    manifest = _project(tmp_path, REAL / "dynamo_llama_tiny_gqa.onnx", "extension = false")
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    sidecar = tmp_path / "golden" / "model.plan"
    # The golden recorded a full split at length 64; today's hints, the same hints as the
    # golden's, cut inside the layers: attention core and q's scale on slices.
    sidecar.write_text(json.dumps({"seq_len": 64, "ranks": 2, "flops_on_slices": 1.0}))
    lowered = run_cli("check", "--manifest", manifest, "--format", "json")
    assert lowered.exit_code == 1
    model = json.loads(lowered.stdout)["models"][0]
    assert model["status"] == "differs"
    assert model["differences"] == []  # the hints match: the plan alone fails
    assert model["plan"]["status"] == "lowered"
    assert model["plan"]["golden_flops_on_slices"] == 1.0
    assert 0 < model["plan"]["flops_on_slices"] < 0.5
    text = run_cli("check", "--manifest", manifest)
    assert text.exit_code == 1
    assert "of FLOPs on slices at length 64 on 2 ranks, below the golden's 100.0%" in text.stdout
    # --update records the new figure; then the gate passes.
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    assert json.loads(sidecar.read_text())["flops_on_slices"] < 0.5
    assert run_cli("check", "--manifest", manifest).exit_code == 0


def test_a_plan_above_its_golden_passes(tmp_path: Path) -> None:
    manifest = _project(tmp_path, REAL / "ts_llama_tiny_gqa.onnx")
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    sidecar = tmp_path / "golden" / "model.plan"
    sidecar.write_text(json.dumps({"seq_len": 64, "ranks": 2, "flops_on_slices": 0.1}))
    raised = run_cli("check", "--manifest", manifest, "--format", "json")
    assert raised.exit_code == 0, raised.stdout
    plan = json.loads(raised.stdout)["models"][0]["plan"]
    assert plan["status"] == "raised" and plan["golden_flops_on_slices"] == 0.1
