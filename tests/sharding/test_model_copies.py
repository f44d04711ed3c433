"""The multi-device models are made beside the model, never out of it: the shard and the
lengths copy only the nodes they change, so the model they read must come out as it went in
(gen goes on reading it, and so do the counts of its second plan). And the model shard writes
keeps what it does not know of the model (the fields of a newer onnx)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, run_cli

from shardcheck import load_index
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph import protos
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


def _varint(value: int) -> bytes:
    out = b""
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            return out + bytes([low])
        out += bytes([low | 0x80])


# A field number no onnx has used, as a varint field: what a newer onnx's field looks like to
# this one (kept as an unknown field when parsed).
UNKNOWN_FIELD = _varint(4000 << 3) + _varint(7)


@pytest.mark.parametrize("plan", ["hints", "extension"])
def test_the_model_shard_writes_keeps_the_fields_onnx_does_not_know(
    plan: str, tmp_path: Path
) -> None:
    model = protos.ModelProto()
    model.ParseFromString((REAL / "dynamo_llama_tiny_gqa.onnx").read_bytes() + UNKNOWN_FIELD)
    graph = protos.GraphProto()
    graph.ParseFromString(model.graph.SerializeToString() + UNKNOWN_FIELD)
    model.graph.CopyFrom(graph)
    source = tmp_path / "newer.onnx"
    source.write_bytes(model.SerializeToString())
    hints = tmp_path / "hints.json"
    assert run_cli("gen", source, "-o", hints, "-q").exit_code == 0
    chosen = hints if plan == "hints" else tmp_path / "hints.shardcheck.json"
    assert chosen.exists()
    written = tmp_path / "md.onnx"
    result = run_cli("shard", source, chosen, "-o", written)
    assert result.exit_code == 0, result.stderr
    sharded = protos.ModelProto()
    sharded.ParseFromString(written.read_bytes())
    assert len(sharded.graph.node) > len(model.graph.node)
    # The model's field comes last on the wire; the graph's is inside the graph's bytes.
    assert sharded.SerializeToString().endswith(UNKNOWN_FIELD)
    assert sharded.graph.SerializeToString().endswith(UNKNOWN_FIELD)
