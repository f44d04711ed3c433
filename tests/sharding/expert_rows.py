"""The rows a mixture of experts' tensors hold on one device and on each of 2 simulated ranks,
under gen's default extension: the tests' own run, at batch 2 and length 16, for the tests of
dispatches that select each expert's tokens (test_moe_loop.py, test_sorted_experts.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from conftest import gen_plan

from shardcheck import load_index
from shardcheck.hints.files import read_hints
from shardcheck.runtime.sessions import run_model
from shardcheck.sharding.rewrite import shard_model
from shardcheck.simulation.plan import untyped_output
from shardcheck.simulation.simulator import RankSimulator

VOCAB = 64  # fixtures/build_real_exports.py's
BATCH, LENGTH = 2, 16


def values_whole_and_on_ranks(
    model: Path, tensors: list[str], directory: Path
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """``tensors``' values on one device and on each of 2 ranks, for seeded token ids."""
    _, extension = gen_plan(model, directory)
    assert extension is not None
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(3, VOCAB, (BATCH, LENGTH), dtype=np.int64),
        "attention_mask": np.ones((BATCH, LENGTH), dtype=np.int64),
    }
    whole_model = onnx.load(model)
    whole_model.graph.output.extend(untyped_output(name) for name in tensors)
    whole = run_model(whole_model, feeds, tensors)
    index = load_index(model)
    sharded = shard_model(index, read_hints(extension))
    per_rank = RankSimulator(sharded, index.model, 2).run(feeds, diagnostic=True).per_rank
    return whole, per_rank
