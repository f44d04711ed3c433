"""check gates the extension gen writes beside the hints as it gates the hints: its golden
``NAME.shardcheck.json`` beside ``NAME.json``, and the plan of the default plan (the extension
where gen writes one) in ``NAME.plan``."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURES, one_model_manifest, run_cli

from shardcheck.hints.files import read_hints

LLAMA = FIXTURES / "real" / "dynamo_llama_tiny_gqa.onnx"


def project(tmp_path: Path, gen: str = "") -> Path:
    return one_model_manifest(tmp_path, LLAMA, gen)


def test_update_writes_the_extension_golden_and_its_plan(tmp_path: Path) -> None:
    manifest = project(tmp_path)
    created = run_cli("check", "--manifest", manifest, "--update")
    assert created.exit_code == 0, created.stdout
    golden = tmp_path / "golden"
    assert read_hints(golden / "model.json").lengths is None
    extension = read_hints(golden / "model.shardcheck.json")
    assert extension.lengths is not None and extension.lengths.rank
    # The plan recorded is the extension's, which runs every projection on slices: above the
    # hints' 95.6% (attention core alone) at the default length.
    assert json.loads((golden / "model.plan").read_text())["flops_on_slices"] > 0.99
    again = run_cli("check", "--manifest", manifest)
    assert again.exit_code == 0, again.stdout
    assert "STALE" not in again.stdout


def test_a_missing_extension_golden_fails_and_update_writes_it(tmp_path: Path) -> None:
    manifest = project(tmp_path)
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    extension = tmp_path / "golden" / "model.shardcheck.json"
    extension.unlink()
    missing = run_cli("check", "--manifest", manifest)
    assert missing.exit_code == 1
    assert f"extension {extension}: no golden; --update writes it" in missing.stdout
    assert missing.stdout.startswith("MISSING")
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    assert extension.exists()


def test_an_extension_that_differs_fails_naming_the_difference(tmp_path: Path) -> None:
    manifest = project(tmp_path)
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    extension = tmp_path / "golden" / "model.shardcheck.json"
    document = json.loads(extension.read_text())
    dropped = document["rank_length"].pop()
    extension.write_text(json.dumps(document, indent=4) + "\n")
    differs = run_cli("check", "--manifest", manifest)
    assert differs.exit_code == 1
    assert differs.stdout.startswith("DIFFERS")
    assert f'extension: lengths[node={dropped}]: added "rank"' in differs.stdout
    report = json.loads(run_cli("check", "--manifest", manifest, "--format", "json").stdout)
    assert report["models"][0]["extension"] == {
        "status": "differs",
        "path": str(extension),
        "problem": None,
        "differences": [
            {
                "kind": "added",
                "path": f"lengths[node={dropped}]",
                "golden": None,
                "candidate": "rank",
            }
        ],
    }


def test_losing_the_extension_fails_on_the_golden_and_on_the_plan(tmp_path: Path) -> None:
    # A change after which gen writes no extension (here: told not to) splits the model less
    # than the golden recorded: both the extension's golden and the plan say so.
    manifest = project(tmp_path)
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    manifest.write_text(manifest.read_text() + "gen = { extension = false }\n")
    lowered = run_cli("check", "--manifest", manifest, "--format", "json")
    assert lowered.exit_code == 1
    model = json.loads(lowered.stdout)["models"][0]
    assert model["status"] == "differs"
    assert model["plan"]["status"] == "lowered"
    text = run_cli("check", "--manifest", manifest).stdout
    assert "gen writes no extension now" in text
    assert "below the golden's" in text
    # --update removes the extension's golden and records the hints' plan.
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    assert not (tmp_path / "golden" / "model.shardcheck.json").exists()
    assert run_cli("check", "--manifest", manifest).exit_code == 0
