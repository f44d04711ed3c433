"""Perceiver-style latents: a learned latent array of fixed length attends to the input.

The right plan: the input is scattered along its sequence, the cross layer (Q from the latents,
K and V from the input) gathers its K and V and computes every latent on every rank, and the
latents' self-attention is computed whole, gathering nothing. The models are real exports
(fixtures/real/*_perceiver_latents.onnx); which layers have latent queries comes from the
PyTorch model (TRUTH.json: the axis of the latents' length, 5), not from shardcheck.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli

from shardcheck import simulate, verify
from shardcheck.hints.files import read_hints

REAL = FIXTURES / "real"
TRUTH = json.loads((REAL / "TRUTH.json").read_text())
MODELS = ["ts_perceiver_latents", "dynamo_perceiver_latents"]


def _gen(tmp_path: Path, name: str) -> tuple[Path, str]:
    out = tmp_path / f"{name}.json"
    result = run_cli("gen", REAL / f"{name}.onnx", "-o", out)
    assert result.exit_code == 0, result.stderr
    return out, result.stderr


def _layers(name: str) -> tuple[str, str]:
    """The Q of the cross layer (K from the input's sequence) and of the latents' own."""
    nodes = TRUTH[name]["attention_nodes"]
    assert all(node.get("q_latent_axis") is not None for node in nodes)
    cross = [n["q_tensor"] for n in nodes if n["k_seq_axis"] is not None]
    own = [n["q_tensor"] for n in nodes if n.get("k_latent_axis") is not None]
    assert len(cross) == len(own) == 1
    return cross[0], own[0]


@pytest.mark.parametrize("name", MODELS)
def test_the_input_is_scattered_and_the_latents_stay_whole(name: str, tmp_path: Path) -> None:
    path, stderr = _gen(tmp_path, name)
    # The latent count is no sequence length: no warning of a length fixed at 5.
    assert "SC120" not in stderr and "fixed at 5" not in stderr
    hints = read_hints(path)
    assert [(t.name, t.seq_len_idx) for t in hints.inputs] == [("x", 1)]
    assert hints.outputs == ()  # the latents are whole on every rank: nothing to gather
    cross, own = _layers(name)
    assert {h.q: h.gather_kv for h in hints.attention_layers} == {cross: True, own: False}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_the_right_hints_pass_verify(name: str, ranks: int, tmp_path: Path) -> None:
    path, _ = _gen(tmp_path, name)
    report = verify(REAL / f"{name}.onnx", path, seq_lens=(8, 16), ranks=ranks)
    assert report.ok, report.render_text()
    # Not SC121 on the latents' self-attention, whose K and V are the whole latents; not
    # SC118 on a Q that has no query axis to change along.
    assert not [f for f in report.findings if f.code in ("SC121", "SC118", "SC117")]
    result = simulate(REAL / f"{name}.onnx", path, ranks=ranks, seq_len=16, dims={"batch": 2})
    assert result.ok, result.summary()


def test_sc121_still_refuses_the_cross_layer_without_its_gather(tmp_path: Path) -> None:
    name = "ts_perceiver_latents"
    path, _ = _gen(tmp_path, name)
    cross, _ = _layers(name)
    document = json.loads(path.read_text())
    for layer in document["attention_layers"]:
        if layer["q"] == cross:
            layer["gather_kv"] = False
    path.write_text(json.dumps(document))
    report = verify(REAL / f"{name}.onnx", path, seq_lens=(8, 16), ranks=2)
    assert not report.ok
    assert [f.tensor for f in report.findings if f.code == "SC121"] == [cross]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["ts_perceiver_io", "dynamo_perceiver_io"])
def test_perceiver_io_scatters_x_and_its_decoder_queries_the_whole_latents(
    name: str, ranks: int, tmp_path: Path
) -> None:
    # The decoder's queries are x's positions (TRUTH.json: a sequence axis on its Q), its K
    # and V the latents' (the latents' length on their axis): a slice of queries each rank.
    path, stderr = _gen(tmp_path, name)
    assert "SC120" not in stderr
    nodes = TRUTH[name]["attention_nodes"]
    decoder = [n["q_tensor"] for n in nodes if n["q_seq_axis"] is not None]
    gathering = [n["q_tensor"] for n in nodes if n["k_seq_axis"] is not None]
    assert len(decoder) == len(gathering) == 1
    hints = read_hints(path)
    assert {h.q for h in hints.attention_layers if h.gather_kv} == set(gathering)
    assert [(t.name, t.seq_len_idx) for t in hints.inputs] == [("x", 1)]
    assert [(t.name, t.seq_len_idx) for t in hints.outputs] == [("y", 1)]
    report = verify(REAL / f"{name}.onnx", path, seq_lens=(8, 16), ranks=ranks)
    assert report.ok, report.render_text()
    result = simulate(REAL / f"{name}.onnx", path, ranks=ranks, seq_len=16, dims={"batch": 2})
    assert result.ok, result.summary()
