"""Fixed-length exports whose masks each rank needs its own rows of (issue 28, classes 2, 10).

DeiT's 16 tokens are fixed by the image: the dynamo exporter folds the mask's rows into a
constant [1, 1, 16, 1] and Expand-s it by the batch alone, so every rank would keep all 16
query rows next to its slice of the scores; scattered along its query axis, it is exact (gen
once called it "no exact cut"). Funnel's relative-shift positional scores are Q's, Reshape-d
across the query axis: computed whole and scattered, they are exact too. DETR's object queries
attend to themselves and to the encoder's memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli

from shardcheck import GenOptions, generate, load_index, verify

REAL = FIXTURES / "real"
FIXED_LENGTH = ["ts_deit_tiny", "dynamo_deit_tiny", "dynamo_funnel_tiny", "dynamo_detr_tiny"]


def test_the_dynamo_deits_mask_is_scattered_along_its_query_axis() -> None:
    hints = generate(load_index(REAL / "dynamo_deit_tiny.onnx"), GenOptions()).hints
    # val_79: Where(Expand(constant, [batch, 1, 16, 16]), 0, -inf), [batch, 1, queries, keys].
    assert ("val_79", 2) in [(t.name, t.seq_len_idx) for t in hints.inputs]


def test_funnels_relative_shift_is_scattered_computed_whole() -> None:
    hints = generate(load_index(REAL / "dynamo_funnel_tiny.onnx"), GenOptions()).hints
    scattered = [(t.name, t.seq_len_idx) for t in hints.inputs]
    # slice_12: the first layer's positional scores after the shift, [batch, heads, 8, 8];
    # view_21: the pooled layer's before its last Slice, [batch, heads, 4, 14].
    assert ("slice_12", 2) in scattered and ("view_21", 2) in scattered


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", FIXED_LENGTH)
def test_default_hints_pass_verify_on_ranks(
    name: str, ranks: int, batch: int, tmp_path: Path
) -> None:
    hints = tmp_path / "h.json"
    result = run_cli("gen", REAL / f"{name}.onnx", "-o", hints)
    assert result.exit_code == 0, result.stderr
    assert "no exact cut" not in result.stderr
    report = verify(REAL / f"{name}.onnx", hints, ranks=ranks, dims={"batch": batch})
    assert report.ok, report.render_text()
    assert any(f.code == "SC202" for f in report.findings)
