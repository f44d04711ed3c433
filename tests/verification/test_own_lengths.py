"""verify's ``--seq-len NAME=L1,L2``: each sequence dim at its own lengths.

An encoder-decoder traced with a source and a target of different lengths (TorchScript's
``nn.Transformer``, fixtures/real/ts_transformer_seq2seq.onnx: source 8, target 4, both held in
Reshapes) runs at that pair only; with both dims at one length it cannot run at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli

from shardcheck import verify

REAL = FIXTURES / "real"
TRUTH = json.loads((REAL / "TRUTH.json").read_text())
TS = REAL / "ts_transformer_seq2seq.onnx"
DYNAMO = REAL / "dynamo_transformer_seq2seq.onnx"


@pytest.fixture(scope="module")
def hints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = {}
    for path in (TS, DYNAMO):
        out = tmp_path_factory.mktemp("hints") / f"{path.stem}.json"
        result = run_cli("gen", path, "-o", out)
        assert result.exit_code == 0, result.stderr
        made[path.stem] = out
    return made


def _simulated_dims(report: object) -> list[dict[str, int]]:
    return [run["dims"] for run in report.runs if run.get("simulation")]  # type: ignore[attr-defined]


def test_one_length_for_both_dims_cannot_run_the_traced_pair(hints: dict[str, Path]) -> None:
    assert TRUTH["ts_transformer_seq2seq"]["traced_lengths_of"] == {"target": 4}
    report = verify(TS, hints[TS.stem], seq_lens=(8, 16), ranks=2)
    assert not report.ok
    assert "SC001" in [f.code for f in report.findings]


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_target_at_its_own_length_runs_and_simulates_at_the_traced_pair(
    hints: dict[str, Path], ranks: int
) -> None:
    report = verify(
        TS, hints[TS.stem], seq_lens=(8, 16), seq_len_of={"target": (4, 8)}, ranks=ranks
    )
    assert report.ok, report.render_text()
    # It runs at (8, 4), not at (16, 8): the traced lengths are baked in (a warning, as the
    # simulation there matched).
    assert [f.level for f in report.findings if f.code == "SC002"] == ["warning"]
    assert _simulated_dims(report) == [{"batch": 1, "source": 8, "target": 4}]


def test_a_dynamic_encoder_decoder_runs_each_pair(hints: dict[str, Path]) -> None:
    report = verify(
        DYNAMO, hints[DYNAMO.stem], seq_lens=(8, 16), seq_len_of={"target": (4, 6)}, ranks=2
    )
    assert report.ok, report.render_text()
    assert _simulated_dims(report) == [
        {"batch": 1, "source": 8, "target": 4},
        {"batch": 1, "source": 16, "target": 6},
    ]


def test_the_cli_takes_it_and_refuses_it_misused(hints: dict[str, Path]) -> None:
    given = ("verify", TS, hints[TS.stem], "--ranks", "2")
    ran = run_cli(*given, "--seq-len", "target=4,8")
    assert ran.exit_code == 0, ran.stdout + ran.stderr
    for wrong, says in (
        (("--seq-len", "target=4"), "give one length per run of --seq-lens 8,16 (2)"),
        (("--seq-len", "target=4,4"), "give different positive lengths"),
        (("--seq-len", "batch=2,4"), "'batch' is not a sequence dim of the model"),
        (("--seq-len", "target"), "expected NAME=L1,L2"),
        (("--seq-len", "target=4,8", "--seq-len", "target=2,4"), "given more than once"),
    ):
        refused = run_cli(*given, *wrong)
        assert refused.exit_code == 2, refused.stdout
        assert says in refused.stderr
        assert "Traceback" not in refused.stderr
