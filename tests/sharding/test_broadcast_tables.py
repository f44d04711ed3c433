"""Tables computed from shapes alone that an Expand broadcasts are scattered before it, in the
extension (frontier/region.py), and the Expand runs on the slice (sharding/lengths.py gives it
its lengths).

DeBERTa clips its relative positions to a table [1, 1, S, S] (int64) and expands it over batch
and heads, [batch, heads, S, S] ([batch * heads, S, S] in DeBERTa-v2, squeezed first), as the
index of each layer's position scores (read off the graphs: the tables below are the Expands'
inputs, the Clips or Squeezes). Scattering the Expand's output sends each rank batch · heads
times the bytes of the table's slice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, gen_plan, run_cli

REAL = FIXTURES / "real"
TS_LAYER = "/model/encoder/layer.{}/attention/self/"
# The tables each export's extension scatters: TorchScript's DeBERTa computes two (content to
# position, position to content) in each layer, DeBERTa-v2 two in its first layer for both.
TABLES = {
    "ts_deberta_tiny": {
        TS_LAYER.format(layer) + clip
        for layer in (0, 1)
        for clip in ("Clip_output_0", "Clip_1_output_0")
    },
    "dynamo_deberta_tiny": {"clamp", "clamp_1"},
    "ts_deberta_v2_tiny": {TS_LAYER.format(0) + f"Squeeze_{n}_output_0" for n in (5, 8)},
    "dynamo_deberta_v2_tiny": {"squeeze_1", "squeeze_2"},
}
S, RANKS, BATCH = 64, 2, 2
INT64 = 8


def _plan(model: Path, hints: Path, *args: object) -> dict:
    result = run_cli("explain", model, hints, "--format", "json", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["plan"]


def _extension(name: str, tmp_path: Path) -> Path:
    _, extension = gen_plan(REAL / f"{name}.onnx", tmp_path)
    assert extension is not None
    return extension


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_relative_positions_are_scattered_before_their_broadcast(
    name: str, tmp_path: Path
) -> None:
    extension = _extension(name, tmp_path)
    scattered = {t["name"] for t in json.loads(extension.read_text())["hints"]["inputs"]}
    assert TABLES[name] <= scattered
    plan = _plan(
        REAL / f"{name}.onnx",
        extension,
        "--seq-len",
        S,
        "--ranks",
        RANKS,
        "--dim",
        f"batch={BATCH}",
    )
    received = {
        c["tensor"]: c["bytes_received_per_rank"]
        for c in plan["collectives"]
        if c["role"] == "scatter"
    }
    # Each rank receives the (N-1)/N of the table [1, 1, S, S] that it lacks, once: not the
    # batch · heads times more of its expansion.
    assert {received[table] for table in TABLES[name]} == {S * S * INT64 * (RANKS - 1) // RANKS}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_each_rank_holds_less_than_one_device(name: str, tmp_path: Path) -> None:
    # At a long sequence the [batch, heads, S, S] index and scores dominate: a rank holds its
    # queries' rows of them, and so about 1/N of one device's peak. With the expanded index
    # computed whole on every rank and scattered, TorchScript's DeBERTa held 89% of it.
    extension = _extension(name, tmp_path)
    plan = _plan(REAL / f"{name}.onnx", extension, "--seq-len", 1024, "--ranks", RANKS)
    memory = plan["activation_memory"]
    assert memory["peak_bytes_per_rank"] < 0.75 * memory["peak_bytes_one_device"]


def test_each_layers_tables_and_reader_gathers_are_its_own_traffic(tmp_path: Path) -> None:
    # TorchScript's DeBERTa computes each layer's tables after its score MatMul, and gathers
    # its K (Slice_1, sliced out of the packed projection) for the position-to-content product
    # MatMul_2 beside the layer (test_kv_for_readers.py): both are that layer's traffic.
    extension = _extension("ts_deberta_tiny", tmp_path)
    plan = _plan(REAL / "ts_deberta_tiny.onnx", extension, "--seq-len", S, "--ranks", RANKS)
    scatters = {c["tensor"]: c["layer"] for c in plan["collectives"] if c["role"] == "scatter"}
    for layer in (0, 1):
        for clip in ("Clip_output_0", "Clip_1_output_0"):
            assert scatters[TS_LAYER.format(layer) + clip] == layer
    readers = [
        (c["tensor"], c["layer"]) for c in plan["collectives"] if c["role"] == "gather for readers"
    ]
    assert readers == [(TS_LAYER.format(layer) + "Slice_1_output_0", layer) for layer in (0, 1)]
