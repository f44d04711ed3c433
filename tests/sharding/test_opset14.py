"""The extension's length reads at opset 14 (graph/build.py ``dim_nodes``; issue 27).

Before opset 15 a Shape takes no ``start`` or ``end``: onnxruntime rejects the whole model. So
the extension reads a length there as a Shape and a Gather of its entry.
fixtures/real/ts_stablelm_opset14.onnx is TorchScript's StableLM at opset 14;
test_lengths_real.py verifies its default plan at 2 and 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from conftest import FIXTURES, gen_plan, run_cli

MODEL = FIXTURES / "real" / "ts_stablelm_opset14.onnx"


def test_the_multi_device_model_reads_its_lengths_as_opset_14_can(tmp_path: Path) -> None:
    _, extension = gen_plan(MODEL, tmp_path)
    assert extension is not None
    multi_device = tmp_path / "md.onnx"
    result = run_cli("shard", MODEL, extension, "-o", multi_device)
    assert result.exit_code == 0, result.stderr
    model = onnx.load(multi_device)
    assert [entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")] == [
        14
    ]
    shapes = [node for node in model.graph.node if node.op_type == "Shape"]
    assert shapes
    assert not [node.name for node in shapes if node.attribute]
    # The extension's own reads: a Shape, then a Gather of one entry.
    added = [node for node in shapes if node.name.endswith("/shape")]
    assert added
    consumers = {name: node for node in model.graph.node for name in node.input}
    assert {consumers[node.output[0]].op_type for node in added} == {"Gather"}
    result = run_cli("verify", MODEL, extension, "--ranks", "2", "-q")
    assert result.exit_code == 0, result.stdout + result.stderr
