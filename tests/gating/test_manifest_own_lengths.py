"""The manifest's ``seq-len = { NAME = [L1, L2] }`` (verify's ``--seq-len NAME=L1,L2``) reaches
verify, in ``check --verify`` and in the pytest plugin: an encoder-decoder whose target needs
lengths of its own passes only with them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from conftest import FIXTURES, one_model_manifest, run_cli

from shardcheck.hints.files import read_hints

# nn.Transformer traced by TorchScript with a source of 8 and a target of 4: its Reshapes hold
# both lengths, so it runs with the target at 4 only, whatever the source's length.
SEQ2SEQ = FIXTURES / "real" / "ts_transformer_seq2seq.onnx"
NAME = SEQ2SEQ.stem
VERIFIED = "verify = true\nranks = 2\nseq-lens = [8, 16]\n"
OWN = "seq-len = { target = [4, 8] }\n"


def gated(directory: Path) -> Path:
    """A manifest gating the model against the goldens gen writes now, verified on 2 ranks at
    source lengths 8 and 16."""
    manifest = one_model_manifest(directory, SEQ2SEQ)
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    manifest.write_text(manifest.read_text() + VERIFIED)
    return manifest


def test_check_verify_passes_only_with_the_targets_own_lengths(tmp_path: Path) -> None:
    manifest = gated(tmp_path)

    # The target takes seq-lens too: at 8 it does not run.
    without = run_cli("check", "--manifest", manifest, "--verify")
    assert without.exit_code == 1
    assert without.stdout.startswith(f"FAILED   {NAME} (verify failed")
    assert (
        "SC001 error: the model does not run in onnxruntime with batch=1, source=8, target=8"
        in (without.stdout)
    )

    manifest.write_text(manifest.read_text() + OWN)
    result = run_cli("check", "--manifest", manifest, "--verify", "--format", "json")

    assert result.exit_code == 0, result.stdout
    (model,) = json.loads(result.stdout)["models"]
    assert model["status"] == "ok"
    # Verify's own report with --seq-lens 8,16 --seq-len target=4,8 --ranks 2.
    verify = importlib.import_module("shardcheck.verification.verify").verify
    direct = verify(
        str(tmp_path / SEQ2SEQ.name),
        read_hints(tmp_path / "golden" / "model.json"),
        ranks=2,
        seq_lens=(8, 16),
        seq_len_of={"target": (4, 8)},
    )
    assert direct.ok
    assert model["verify"]["report"]["findings"] == direct.to_json()["findings"]
    # The simulation ran where the model runs: source 8, target 4.
    assert any(
        f["code"] == "SC202" and "at length 8" in f["message"]
        for f in model["verify"]["report"]["findings"]
    )


def test_the_plugin_verify_item_takes_the_own_lengths(pytester: pytest.Pytester) -> None:
    manifest = gated(pytester.path)
    run = ("-p", "no:hypothesispytest", "--shardcheck", "-k", "verify")
    failing = pytester.runpytest(*run)
    failing.assert_outcomes(failed=1, deselected=2)
    assert "source=8, target=8" in failing.stdout.str()

    manifest.write_text(manifest.read_text() + OWN)
    pytester.runpytest(*run).assert_outcomes(passed=1, deselected=2)
