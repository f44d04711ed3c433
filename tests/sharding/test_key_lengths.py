"""A view of the scores sized along the keys by K's length before its gather.

TorchScript's XGLM computes each layer's scores over [batch * heads, sequence, head_dim] and
views them to [batch, heads, queries, keys] for the mask, the keys' entry read off K's own
reshape (``Reshape_4``), before the hints gather K at the score MatMul: on a rank that is a
slice's length where the keys are whole. No Polygraphy-format cut is exact (gen warns SC308
and the simulation differs); the extension gives those views (``Reshape_6`` to ``Reshape_9``,
read off the graph) a rank's queries and every key (sharding/lengths.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURES, run_cli

MODEL = FIXTURES / "real" / "ts_xglm_tiny.onnx"
LAYER = "/model/layers.{}/self_attn/"


def _gen(tmp_path: Path) -> tuple[Path, Path]:
    result = run_cli("gen", MODEL, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert "sized along the keys by the length of /model/layers.0/self_attn/Reshape_4" in (
        result.stderr
    )
    return tmp_path / "h.json", tmp_path / "h.shardcheck.json"


def test_the_views_of_the_scores_get_every_key(tmp_path: Path) -> None:
    _, extension = _gen(tmp_path)
    document = json.loads(extension.read_text())
    assert document["rank_length"] == [
        LAYER.format(layer) + f"Reshape_{view}" for layer in (0, 1) for view in (6, 7, 8, 9)
    ]


def test_the_hints_differ_and_the_extension_does_not(tmp_path: Path) -> None:
    hints, extension = _gen(tmp_path)
    result = run_cli("verify", MODEL, hints, "--ranks", "2", "-q")
    assert result.exit_code == 1 and "SC201" in result.stdout
    assert run_cli("verify", MODEL, extension, "--ranks", "2", "-q").exit_code == 0
    # Without the views given their lengths the split run differs again.
    document = json.loads(extension.read_text())
    document["rank_length"] = []
    bare = tmp_path / "bare.shardcheck.json"
    bare.write_text(json.dumps(document))
    result = run_cli("verify", MODEL, bare, "--ranks", "2", "-q")
    assert result.exit_code == 1 and "SC201" in result.stdout
