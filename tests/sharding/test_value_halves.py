"""A layer's probabilities multiplied by a second tensor beside the layer (frontier/whole.py).

DiffLlama's differential attention multiplies each layer's probabilities by both halves of its
V, split along the head dim: the dynamo exporter merges the two attention calls, so one Softmax
feeds the layer's product with the first half and a second product, beside the layer, with the
other (read off the graph: the Split before the two products). Every rank needs that half over
every key, as it does V: computed from a slice of V, it would hold the rank's keys only, and the
second product could not run. Before the walk followed a Split's other pieces beside it, gen
wrote an extension whose multi-device model failed verify at every setting.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, assert_verified_at_two_and_four_ranks, gen_plan

MODEL = FIXTURES / "real" / "dynamo_diffllama_tiny.onnx"


@pytest.mark.parametrize("which", ["hints", "default plan"])
def test_both_plans_of_diffllama_are_exact(which: str, tmp_path: Path) -> None:
    hints, extension = gen_plan(MODEL, tmp_path)
    plan = extension if which == "default plan" and extension is not None else hints
    assert_verified_at_two_and_four_ranks(MODEL, plan)
