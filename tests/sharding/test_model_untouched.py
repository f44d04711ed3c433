"""The multi-device models are made beside the model, never out of it: the shard and the
lengths copy only the nodes they change, so the model they read must come out as it went in
(gen goes on reading it, and so do the counts of its second plan)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import FIXTURES

from shardcheck import load_index
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.sharding.rewrite import shard_model

REAL = FIXTURES / "real"
# Each has an extension whose lengths change nodes (Reshapes given a rank's length, positions
# computed with the whole one), and hints whose scatters move consumers.
MODELS = ["dynamo_llama_tiny_gqa", "dynamo_gemma3_window", "ts_deberta_v2_tiny"]


@pytest.mark.parametrize("name", MODELS)
def test_gen_and_shard_leave_the_model_as_it_was(name: str) -> None:
    index = load_index(REAL / f"{name}.onnx")
    before = index.model.SerializeToString()
    result = generate(index, GenOptions())
    assert result.extension is not None
    assert result.extension.hints.lengths is not None
    assert result.extension.hints.lengths.rank or result.extension.hints.lengths.whole
    for hints in (result.hints, result.extension.hints):
        for weights in (True, False):
            sharded = shard_model(index, hints, weights=weights).model
            assert len(sharded.graph.node) > len(index.model.graph.node)
    assert index.model.SerializeToString() == before


@pytest.mark.parametrize("name", MODELS)
def test_the_lengths_leave_the_shard_they_are_given_as_it_was(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lengths are given on a copy of the nodes they change (sharding/lengths.py); the
    # multi-device model they start from, gen's and shard's, is not theirs to change. Both
    # entry points are watched: gen's (length_readers) and shard's (give_lengths).
    from shardcheck.sharding import lengths

    seen: list[tuple[bytes, bytes, bytes]] = []

    def watched(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            sharded = args[4]
            before = sharded.model.SerializeToString()
            given = real(*args)
            made = (given[1] if isinstance(given, tuple) else given).model
            seen.append((before, sharded.model.SerializeToString(), made.SerializeToString()))
            return given

        return call

    monkeypatch.setattr(lengths, "length_readers", watched(lengths.length_readers))
    monkeypatch.setattr(lengths, "give_lengths", watched(lengths.give_lengths))
    index = load_index(REAL / f"{name}.onnx")
    result = generate(index, GenOptions())
    assert result.extension is not None
    shard_model(index, result.extension.hints)
    assert len(seen) == 2  # gen's, then shard's
    for before, after, given in seen:
        assert after == before
        assert given != before  # the lengths did change nodes, in the model they made
