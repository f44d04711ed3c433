"""A layer's probabilities multiplied by a second tensor beside the layer (frontier/whole.py,
frontier/kv_readers.py).

DiffLlama's differential attention multiplies each layer's probabilities by both halves of its
V, split along the head dim: the dynamo exporter merges the two attention calls, so one Softmax
feeds the layer's product with the first half and a second product, beside the layer, with the
other (read off the graph: the Split before the two products; the builder records the second
products in TRUTH.json from the torch side). Every rank needs that half over every key, as it
does V. Before the walk followed a Split's other pieces beside it, gen wrote an extension whose
multi-device model failed verify at every setting; then it kept V whole, and with it the
residual stream, so only 11% of the projection work ran on slices. The extension now gathers
that half for its product, as the layer gathers its own V.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, assert_verified_at_two_and_four_ranks, gen_plan, read_json

from shardcheck import load_index
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

MODEL = FIXTURES / "real" / "dynamo_diffllama_tiny.onnx"
TRUTH = json.loads((FIXTURES / "real" / "TRUTH.json").read_text())["dynamo_diffllama_tiny"]


@pytest.mark.parametrize("which", ["hints", "default plan"])
def test_both_plans_of_diffllama_are_exact(which: str, tmp_path: Path) -> None:
    hints, extension = gen_plan(MODEL, tmp_path)
    plan = extension if which == "default plan" and extension is not None else hints
    assert_verified_at_two_and_four_ranks(MODEL, plan)


def test_the_second_half_of_v_is_gathered_for_its_product(tmp_path: Path) -> None:
    _, extension = gen_plan(MODEL, tmp_path)
    assert extension is not None
    index = load_index(MODEL)
    expected = []
    for layer in TRUTH["attention_nodes"]:
        (product,) = layer["other_probs_matmuls"]
        (node,) = [node for node in index.nodes if node.name == product]
        # The product weighs its half by the layer's own probabilities.
        assert node.inputs[0] == layer["probs_matmul"]["inputs"][0]
        expected.append(
            {"name": node.inputs[1], "seq_len_idx": layer["v_seq_axis"], "nodes": [product]}
        )
    assert read_json(extension)["gathered_for_readers"] == expected
    plan = make_plan(index, read_hints(extension))
    assert plan.classes["projections"].share_on_slices == 1.0


def test_each_gather_of_a_second_half_belongs_to_its_layer(tmp_path: Path) -> None:
    _, extension = gen_plan(MODEL, tmp_path)
    assert extension is not None
    seq_len, ranks = 4096, 2
    plan = make_plan(load_index(MODEL), read_hints(extension), seq_len=seq_len, ranks=ranks)
    for_readers = [c for c in plan.collectives if c.role == "gather for readers"]
    assert [c.layer for c in for_readers] == [0, 1]
    # A half of V, GQA-expanded to the 4 query heads of 8 dims, in float32 at batch 1: each
    # rank receives the other rank's half of it.
    assert [c.bytes_received for c in for_readers] == [4 * seq_len * 8 * 4 // ranks] * 2
