"""Encoder-decoders split on each of their sequence dims (issue 27).

The decoder runs along a length of its own (``decoder_sequence``, ``target``); its
cross-attention's keys are the encoder's. gen's default plan (the hints, plus the extension
where gen writes one) runs at least 95% of the projection and MLP FLOPs on slices, counted here
on the multi-device model ``shardcheck shard`` writes, independently of planning/; and it passes
``verify --ranks 2`` and ``--ranks 4`` at batch 1 and 2 with the decoder at other lengths than
the encoder, as do the Polygraphy-format hints beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli
from projection_count import projection_share_on_slices
from test_lengths_real import REAL, default_plan

from shardcheck import load_index
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

# Each export's decoder length (its decoder input's second dim, read in the graph inputs).
DECODER_DIM = {
    "ts_bart_seq2seq_tiny": "decoder_sequence",
    "ts_t5_tiny": "target",
    "dynamo_transformer_seq2seq": "target",
}


@pytest.mark.parametrize("name", sorted(DECODER_DIM))
def test_the_default_plan_splits_the_encoder_and_the_decoder(name: str, tmp_path: Path) -> None:
    hints, extension = default_plan(name, tmp_path)
    plan_file = extension or hints
    multi_device = tmp_path / "md.onnx"
    result = run_cli("shard", REAL / f"{name}.onnx", plan_file, "-o", multi_device)
    assert result.exit_code == 0, result.stderr
    assert projection_share_on_slices(multi_device) >= 0.95
    # planning/'s count (what gen and explain print) agrees.
    plan = make_plan(load_index(REAL / f"{name}.onnx"), read_hints(plan_file))
    assert plan.classes["projections"].share_on_slices >= 0.95


def test_the_hints_alone_split_only_part_where_an_extension_is_written(tmp_path: Path) -> None:
    # BART's Polygraphy-format cut sits after its positions (read off a slice's length): the
    # count must tell the plans apart, or the test above would prove nothing of the extension.
    hints, extension = default_plan("ts_bart_seq2seq_tiny", tmp_path)
    assert extension is not None
    multi_device = tmp_path / "md.onnx"
    model = REAL / "ts_bart_seq2seq_tiny.onnx"
    assert run_cli("shard", model, hints, "-o", multi_device).exit_code == 0
    assert projection_share_on_slices(multi_device) < 0.95


@pytest.mark.parametrize("name", sorted(DECODER_DIM))
@pytest.mark.parametrize("which", ["plan", "hints"])
def test_the_plan_is_exact_with_the_decoder_at_its_own_lengths(
    name: str, which: str, tmp_path: Path
) -> None:
    hints, extension = default_plan(name, tmp_path)
    tested = (extension or hints) if which == "plan" else hints
    for ranks in (2, 4):
        for batch in (1, 2):
            result = run_cli(
                "verify", REAL / f"{name}.onnx", tested, "--ranks", ranks,
                "--dim", f"batch={batch}", "--seq-lens", "8,16",
                "--seq-len", f"{DECODER_DIM[name]}=12,24", "-q",
            )  # fmt: skip
            assert result.exit_code == 0, (ranks, batch, result.stdout, result.stderr)


@pytest.mark.parametrize("name", sorted(DECODER_DIM))
def test_polygraphy_loads_and_shards_the_hints_that_now_cut_the_decoder(
    name: str, tmp_path: Path
) -> None:
    multi_device = pytest.importorskip("polygraphy.tools.multi_device")
    tools = pytest.importorskip("polygraphy.tools")
    hints, _ = default_plan(name, tmp_path)
    # The decoder's stream [batch, length, hidden] is scattered along its own length, before
    # its projections (the hints cut only inside its layers, at rank 4, before issue 27).
    index = load_index(REAL / f"{name}.onnx")
    shapes = ShapeInference(index)
    streams = [t for t in read_hints(hints).inputs if t.rank == 3]
    assert DECODER_DIM[name] in {shapes.shape(t.name)[t.seq_len_idx] for t in streams}  # type: ignore[index]
    loaded = multi_device.ShardHints.load(str(hints))
    assert [t.name for t in loaded.inputs] == [t.name for t in read_hints(hints).inputs]
    out = tmp_path / "polygraphy.onnx"
    model = REAL / f"{name}.onnx"
    code = tools.main(["multi-device", "shard", str(model), "-s", str(hints), "-o", str(out)])
    assert code in (0, None)
    assert out.exists()
