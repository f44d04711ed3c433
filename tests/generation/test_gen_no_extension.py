"""gen says why it writes no extension where it declined the extension's cut as not exact
(issue 27's QA: a mixture of experts got none, without a word)."""

from __future__ import annotations

from pathlib import Path

from conftest import FIXTURES, run_cli

from shardcheck import GenOptions, generate, load_index

CONVBERT = FIXTURES / "real" / "ts_convbert_tiny.onnx"
# ConvBERT mixes positions in a convolution beside its attention, so the extension's cut is not
# exact: gen's last check (sharding/lengths.py's mixed_lengths) finds this Mul of its second
# layer broadcasting the whole length against a rank's on a rank.
WHY = (
    "no extension written: node /model/encoder/layer.1/attention/self/Mul of its multi-device "
    "model would mix the whole sequence length with a rank's length"
)


def test_gen_names_the_node_that_keeps_the_extension_out(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    result = run_cli("gen", CONVBERT, "-o", hints)
    assert result.exit_code == 0, result.stderr
    assert f"shardcheck: {hints}: {WHY}\n" in result.stderr
    assert not (tmp_path / "h.shardcheck.json").exists()
    quiet = run_cli("gen", CONVBERT, "-o", hints, "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_no_word_where_the_extension_is_off_or_written(tmp_path: Path) -> None:
    off = run_cli("gen", CONVBERT, "-o", tmp_path / "off.json", "--no-extension")
    assert "no extension written" not in off.stderr
    llama = FIXTURES / "real" / "dynamo_llama_tiny_gqa.onnx"
    result = generate(load_index(llama), GenOptions())
    assert result.extension is not None and result.no_extension is None
