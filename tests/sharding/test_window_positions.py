"""A length read off a tensor that a rank_length node resized (sharding/lengths.py; issue 27).

transformers 4.57's ModernBERT (fixtures/real/ts_modernbert_tf4.onnx, TorchScript) expands its
padding mask over the queries into a global mask [batch, 1, S, S], then builds its local
layer's window from ``arange(global_mask.shape[2])``. The extension expands the global mask over
a rank's queries (``rank_length``) and scatters the window, computed whole. The window's
positions must then count the whole length: read off the global mask's Shape on a rank they
counted a rank's, and the simulation differed at that Range. test_lengths_real.py verifies the
plan at 2 and 4 ranks, batch 1 and 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from conftest import FIXTURES, run_cli
from graph_reads import shapes_read

MODEL = FIXTURES / "real" / "ts_modernbert_tf4.onnx"
GLOBAL_MASK = "/model/Where_1_output_0"
WINDOW_RANGE = "/model/Range_1"


def test_the_window_positions_count_the_whole_length(tmp_path: Path) -> None:
    assert run_cli("gen", MODEL, "-o", tmp_path / "h.json").exit_code == 0
    extension = tmp_path / "h.shardcheck.json"
    assert json.loads(extension.read_text())["rank_length"] == ["/model/Expand"]
    multi_device = tmp_path / "md.onnx"
    assert run_cli("shard", MODEL, extension, "-o", multi_device).exit_code == 0
    graph = onnx.load(multi_device).graph
    [window] = [node for node in graph.node if node.name.startswith(f"{WINDOW_RANGE}/")]
    reads = shapes_read(graph, window.input[1])
    # Its limit is the mask's Shape entry 2, the queries: now input_ids' whole length there,
    # not the global mask's, which holds a rank's.
    assert ("input_ids", 1) in reads
    assert (GLOBAL_MASK, 2) not in reads
    result = run_cli("verify", MODEL, extension, "--ranks", "2", "-q")
    assert result.exit_code == 0, result.stdout
