"""A weight stored as a sparse initializer is a weight (issue 28, class 7): the hints and the
simulation are those of the same model with the weight stored dense."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, run_cli
from onnx import helper, numpy_helper

from shardcheck import GenOptions, generate, load_index, verify

DENSE = FIXTURES / "real" / "ts_sdpa.onnx"


def _with_sparse_q_weight(path: Path, coordinates: bool) -> tuple[Path, np.ndarray]:
    """ts_sdpa.onnx with its Q projection's weight as a sparse initializer (its zeros, a
    quarter of the values, left out); ``coordinates``: indices as [nnz, 2] rows, else flat."""
    model = onnx.load(DENSE)
    graph = model.graph
    q_proj = next(node for node in graph.node if node.name == "/q_proj/MatMul")
    weight = next(t for t in graph.initializer if t.name == q_proj.input[1])
    dense = numpy_helper.to_array(weight).copy()
    dense[np.random.default_rng(0).random(dense.shape) < 0.25] = 0
    flat = np.flatnonzero(dense)
    indices = np.stack(np.unravel_index(flat, dense.shape), axis=1) if coordinates else flat
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(dense.reshape(-1)[flat], weight.name),
        numpy_helper.from_array(indices.astype(np.int64), ""),
        list(dense.shape),
    )
    graph.initializer.remove(weight)
    graph.sparse_initializer.append(sparse)
    out = path / f"sparse_{'coordinates' if coordinates else 'flat'}.onnx"
    onnx.save(model, out)
    return out, dense


@pytest.mark.parametrize("coordinates", [False, True])
def test_a_sparse_projection_weight_gives_the_dense_models_hints(
    tmp_path: Path, coordinates: bool
) -> None:
    sparse, _ = _with_sparse_q_weight(tmp_path, coordinates)
    expected = generate(load_index(DENSE), GenOptions()).hints
    assert generate(load_index(sparse), GenOptions()).hints == expected
    # The loader made it an initializer like the others.
    index = load_index(sparse)
    assert not index.model.graph.sparse_initializer


def test_the_loaded_weight_holds_the_sparse_values(tmp_path: Path) -> None:
    sparse, dense = _with_sparse_q_weight(tmp_path, coordinates=True)
    index = load_index(sparse)
    name = next(n.inputs[1] for n in index.nodes if n.name == "/q_proj/MatMul")
    assert np.array_equal(numpy_helper.to_array(index.initializers[name]), dense)


def test_a_sparse_weights_hints_pass_verify_and_the_simulation(tmp_path: Path) -> None:
    sparse, _ = _with_sparse_q_weight(tmp_path, coordinates=False)
    hints = tmp_path / "h.json"
    assert run_cli("gen", sparse, "-o", hints).exit_code == 0
    report = verify(sparse, hints, seq_lens=(8, 16), ranks=2)
    assert report.ok, report.render_text()
    assert any(f.code == "SC202" for f in report.findings)
