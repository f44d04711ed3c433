"""Cross-attention to a context of its own length (DiT / PixArt blocks): the context stays
whole on every rank, the cross layers gather nothing, their Q is scattered.

The models are real exports (fixtures/real/*_cross_attention_dit.onnx); which layers are
cross-attention comes from the PyTorch model (TRUTH.json: their K and V have no sequence axis,
the context's length on one axis), not from shardcheck.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, run_cli

from shardcheck import simulate, verify
from shardcheck.hints.files import read_hints

REAL = FIXTURES / "real"
TRUTH = json.loads((REAL / "TRUTH.json").read_text())
MODELS = ["ts_cross_attention_dit", "dynamo_cross_attention_dit"]
# The context's length at export (the PyTorch model's CONTEXT_LEN): where K and V carry it.
TRUTH_CONTEXT_LEN = 6


def _gen(tmp_path: Path, name: str, *options: str) -> Path:
    out = tmp_path / f"{name}.json"
    result = run_cli("gen", REAL / f"{name}.onnx", "-o", out, *options)
    assert result.exit_code == 0, result.stderr
    return out


def _cross_queries(name: str) -> list[str]:
    return [
        node["q_tensor"]
        for node in TRUTH[name]["attention_nodes"]
        if node["k_seq_axis"] is None and node.get("k_context_axis") is not None
    ]


@pytest.mark.parametrize("name", MODELS)
def test_the_context_stays_whole_and_the_cross_layers_gather_nothing(
    name: str, tmp_path: Path
) -> None:
    hints = read_hints(_gen(tmp_path, name))
    cross = _cross_queries(name)
    assert len(cross) == 2  # one per block, as the PyTorch model has
    assert {h.q for h in hints.attention_layers if not h.gather_kv} == set(cross)
    assert all(h.gather_kv for h in hints.attention_layers if h.q not in cross)
    # Nothing scattered carries the context: the graph input stays whole, and no hinted
    # tensor is computed from it alone (the cross layers' K and V).
    assert "context" not in {t.name for t in hints.inputs}
    for node in TRUTH[name]["attention_nodes"]:
        if node["q_tensor"] in cross:
            assert node["k_tensor"] not in {t.name for t in hints.inputs}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_gen_hints_pass_verify_and_the_simulation(name: str, ranks: int, tmp_path: Path) -> None:
    hints = _gen(tmp_path, name)
    report = verify(REAL / f"{name}.onnx", hints, seq_lens=(8, 16), ranks=ranks)
    assert report.ok, report.render_text()
    assert not [f for f in report.findings if f.code in ("SC121", "SC117", "SC109")]
    # A context longer than the ranks divide, and a batch of 2: still exact.
    result = simulate(
        REAL / f"{name}.onnx", hints, ranks=ranks, seq_len=16, dims={"context": 5, "batch": 2}
    )
    assert result.ok, result.summary()


def test_the_cross_layers_stay_native_under_cp_type_fused(tmp_path: Path) -> None:
    name = "dynamo_cross_attention_dit"
    result = run_cli(
        "gen", REAL / f"{name}.onnx", "--cp-type", "fused", "--nb-rank", "2", "-o", tmp_path / "h"
    )
    assert result.exit_code == 0, result.stderr
    assert "[SC309]" in result.stderr and "carry the context dim context" in result.stderr
    hints = read_hints(tmp_path / "h")
    cross = set(_cross_queries(name))
    for hint in hints.attention_layers:
        assert (hint.replace is None) == (hint.q in cross)
        assert not hint.gather_kv  # fused layers gather inside the op; the cross ones, nothing
    report = verify(REAL / f"{name}.onnx", tmp_path / "h", seq_lens=(8, 16), ranks=2)
    assert report.ok, report.render_text()


def test_scattering_the_contexts_k_and_v_is_refused_as_no_sequence_axis(tmp_path: Path) -> None:
    # What gen wrote before: the cross layers' K and V scattered along the context's axis.
    name = "ts_cross_attention_dit"
    good = json.loads(_gen(tmp_path, name).read_text())
    cross = [n for n in TRUTH[name]["attention_nodes"] if n["q_tensor"] in _cross_queries(name)]
    wrong = dict(good)
    wrong["attention_layers"] = [{**layer, "gather_kv": True} for layer in good["attention_layers"]]
    wrong["inputs"] = [
        *good["inputs"],
        {**good["inputs"][0], "name": cross[0]["v_tensor"], "seq_len_idx": 2, "rank": 4},
    ]
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(wrong))
    report = verify(REAL / f"{name}.onnx", path, seq_lens=(8, 16), ranks=2)
    assert not report.ok
    no_axis = [f for f in report.findings if f.code == "SC117"]
    assert [f.tensor for f in no_axis] == [cross[0]["v_tensor"]]


@pytest.mark.parametrize("name", MODELS)
def test_a_context_of_fixed_length_stays_whole_too(name: str, tmp_path: Path) -> None:
    # The export with the context's length fixed (a text encoder's 77 tokens, say): its K and
    # V have a fixed key dim beside symbolic queries, as a traced length has, but they are
    # computed from the context alone.
    model = onnx.load(REAL / f"{name}.onnx")
    context = next(i for i in model.graph.input if i.name == "context")
    context.type.tensor_type.shape.dim[1].dim_value = TRUTH_CONTEXT_LEN
    path = tmp_path / "fixed_context.onnx"
    onnx.save(model, path)
    out = tmp_path / "h.json"
    assert run_cli("gen", path, "-o", out, "--no-extension").exit_code == 0
    hints = read_hints(out)
    assert {h.q for h in hints.attention_layers if not h.gather_kv} == set(_cross_queries(name))
    report = verify(path, out, seq_lens=(8, 16), ranks=4)
    assert report.ok, report.render_text()
