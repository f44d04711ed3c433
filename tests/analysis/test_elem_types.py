"""The element types dtypes.py infers are the types onnxruntime computes: every tensor of every
real export is run and compared, and a fixture's hand-made graph checks the rules one by one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import pytest
from conftest import FIXTURES, read_json
from onnx import TensorProto, helper

from shardcheck.analysis.elem_types import infer_elem_types
from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.graph.loader import load_index
from shardcheck.hints.model import ShardHints
from shardcheck.runtime.feeds import make_feeds
from shardcheck.runtime.sessions import run_model
from shardcheck.runtime.sizes import graph_input_dims, resolve_dims
from shardcheck.simulation.plan import untyped_output

# A model that runs at one length only (TRUTH.json's traced_seq_len) is run at that length.
TRUTH = read_json(FIXTURES / "real" / "TRUTH.json")
# Not those that fail on one device at inputs that select other experts than the export's
# (SC003, tests/analysis/test_baked_selections.py): these feeds are not the export's.
REAL = sorted(
    path
    for path in (FIXTURES / "real").glob("*.onnx")
    if "fails_where_selections_differ" not in TRUTH[path.stem]
)


def _declared(model: onnx.ModelProto) -> dict[str, int]:
    known = {t.name: t.data_type for t in model.graph.initializer}
    known.update((i.name, i.type.tensor_type.elem_type) for i in model.graph.input)
    return known


@pytest.mark.parametrize("path", REAL, ids=[p.stem for p in REAL])
def test_inferred_types_are_those_of_the_values_onnxruntime_computes(path: Path) -> None:
    index = load_index(path)
    model = onnx.ModelProto()
    # Layers in model-local functions: their nodes, inlined (the calls' outputs have no rule).
    model.CopyFrom(onnx.inliner.inline_local_functions(index.model))
    inferred = infer_elem_types(model.graph.node, _declared(model))
    produced = [name for node in model.graph.node for name in node.output if name]
    declared = {o.name for o in model.graph.output}
    model.graph.output.extend(untyped_output(n) for n in produced if n not in declared)
    # Every length dim at the length (an encoder-decoder has two).
    length = TRUTH[path.stem].get("traced_seq_len", 8)
    # Some at a traced length of their own (nn.Transformer's target).
    own = TRUTH[path.stem].get("traced_lengths_of", {})
    lengths = {n: own.get(n, length) for n in graph_input_dims(index) if not BATCH_LIKE.search(n)}
    dims = resolve_dims(index, ShardHints(), length, lengths)
    values = run_model(model, make_feeds(index, dims, seed=0))
    checked = [name for name in produced if name in inferred]
    assert len(checked) >= 0.95 * len(produced), "the rules should cover exporters' graphs"
    wrong = {
        name: (inferred[name], helper.np_dtype_to_tensor_dtype(values[name].dtype))
        for name in checked
        if inferred[name] != helper.np_dtype_to_tensor_dtype(values[name].dtype)
    }
    assert not wrong


def test_each_kind_of_rule() -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["as_float"], to=TensorProto.FLOAT16),
        helper.make_node("Equal", ["shape", "shape"], ["same"]),
        helper.make_node("Where", ["same", "x", "x"], ["picked"]),
        helper.make_node("Constant", [], ["c"], value_int=3),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("LayerNormalization", ["x", "w"], ["normed", "mean"]),
        helper.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2),
        helper.make_node("Custom", ["x"], ["unknown"], domain="vendor"),
        helper.make_node("Relu", ["unknown"], ["after_unknown"]),
        helper.make_node("DistCollective", ["x"], ["gathered"], domain="trt"),
    ]
    types = infer_elem_types(
        nodes, {"x": TensorProto.DOUBLE, "w": TensorProto.DOUBLE}, same_as_input="DistCollective"
    )
    assert types == {
        "x": TensorProto.DOUBLE,
        "w": TensorProto.DOUBLE,
        "shape": TensorProto.INT64,
        "as_float": TensorProto.FLOAT16,
        "same": TensorProto.BOOL,
        "picked": TensorProto.DOUBLE,
        "c": TensorProto.INT64,
        "zeros": TensorProto.FLOAT,
        "normed": TensorProto.DOUBLE,  # not "mean": its type is the stash type
        "a": TensorProto.DOUBLE,
        "b": TensorProto.DOUBLE,
        "gathered": TensorProto.DOUBLE,
    }
    assert np.dtype("float64") == helper.tensor_dtype_to_np_dtype(types["x"])
