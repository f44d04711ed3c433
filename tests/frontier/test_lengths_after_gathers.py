"""A length read after the gathers from a tensor ranks hold slices of (issue 28, TorchScript T5).

Each T5 layer reshapes its gathered context [B, H, Sq, D] to ``[B, -1, len(Q), D]``, with
``len(Q)`` read by a Shape of Q after its head split and Transpose (Concat_3 of the second
decoder layer's cross-attention). Cut before that Shape, every rank reads its slice's length
where the data holds the whole query length, and the Reshape's -1 takes up the rest: the
context comes out [1, 8, 4, 8] instead of [1, 4, 8, 8]. The cut belongs after it, at the Q
entering the scores, or before the projection, where Q and the context are both slices; since
the frontier follows the decoder's own length (``target``, issue 27), it is before: at the
residual stream entering the layer. gen's hints at 2 and 4 ranks and batch 2 are in
tests/generation/test_gen_real.py (ts_t5_tiny is in its shardable set).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli

from shardcheck import GenOptions, generate, load_index, simulate
from shardcheck.hints.files import read_hints

T5 = FIXTURES / "real" / "ts_t5_tiny.onnx"
CROSS = "/model/decoder/block.1/layer.1/EncDecAttention"


def test_the_last_cross_attention_is_cut_after_the_shape_its_context_is_reshaped_by() -> None:
    index = load_index(T5)
    reshape = index.producer_of(f"{CROSS}/Reshape_3_output_0")
    assert reshape is not None
    # Read by hand in the graph: the Reshape's target takes its third entry from the Shape
    # of Q after the Transpose (Q enters the scores through the Mul by the scale, 1.0 in T5).
    assert reshape.inputs[1] == f"{CROSS}/Concat_3_output_0"
    shape_of_q = index.producer_of(f"{CROSS}/Shape_2_output_0")
    assert shape_of_q is not None and shape_of_q.inputs[0] == f"{CROSS}/Transpose_output_0"
    scattered = {t.name: t.seq_len_idx for t in generate(index, GenOptions()).hints.inputs}
    # Read by hand too: the Add of the layer before (self-attention's output added to the
    # residual) is the layer norm's input, [B, Sq, 32]; Q is projected from the norm's output.
    residual = "/model/decoder/block.1/layer.0/Add_output_0"
    norm = index.producer_of("/model/decoder/block.1/layer.1/layer_norm/Cast_output_0")
    assert norm is not None and norm.inputs[0] == residual
    assert scattered.get(residual) == 1  # [B, Sq, 32]: the query axis
    assert f"{CROSS}/Mul_output_0" not in scattered
    assert f"{CROSS}/Reshape_output_0" not in scattered
    assert f"{CROSS}/Transpose_output_0" not in scattered


def test_gen_hints_are_exact_with_a_target_of_its_own_length(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    assert run_cli("gen", T5, "-o", hints).exit_code == 0
    result = simulate(T5, hints, ranks=2, seq_len=8, dims={"target": 4})
    assert result.ok, result.summary()


@pytest.mark.parametrize(("ranks", "batch"), [(2, 1), (4, 1), (2, 2)])
def test_the_extension_gen_writes_is_exact(ranks: int, batch: int, tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    assert run_cli("gen", T5, "-o", hints).exit_code == 0
    extension = tmp_path / "h.shardcheck.json"
    # It runs more of the projections on slices than the hints; its own shard gives the
    # whole length to the Gathers indexing whole data only, so the same Shape holds there.
    assert read_hints(extension).inputs != read_hints(hints).inputs
    result = simulate(T5, extension, ranks=ranks, seq_len=16, dims={"batch": batch})
    assert result.ok, result.summary()
