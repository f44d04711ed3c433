"""The extension file's codec (hints/extension.py): its own small versioned format, read
wherever hints are read, every field checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardcheck.errors import HintsFormatError
from shardcheck.hints.codec import dumps, encode
from shardcheck.hints.extension import (
    dumps_extension,
    extension_path,
    hints_text,
    loads_hints_or_extension,
)
from shardcheck.hints.files import read_hints, write_hints
from shardcheck.hints.model import AttentionLayerHint, LengthReads, ShardHints, ShardTensor

HINTS = ShardHints(
    attention_layers=(AttentionLayerHint("q", gather_kv=True, gather_q=False),),
    inputs=(ShardTensor("input_ids", 1, 2),),
    outputs=(ShardTensor("y", 1, 3),),
    k_seq_len_idx=3,
    v_seq_len_idx=2,
    kv_rank=4,
)
EXTENDED = HINTS.with_changes(lengths=LengthReads(whole=("gather",), rank=("view", "expand")))


def document(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "shardcheck_extension": "lengths",
        "version": 1,
        "hints": encode(HINTS),
        "whole_length": ["gather"],
        "rank_length": ["view", "expand"],
    }
    base.update(changes)
    return base


def test_an_extension_file_round_trips_with_its_lengths(tmp_path: Path) -> None:
    path = tmp_path / "h.shardcheck.json"
    write_hints(str(path), EXTENDED)
    assert json.loads(path.read_text()) == document()
    assert read_hints(path) == EXTENDED
    assert path.read_text() == dumps_extension(EXTENDED) == hints_text(EXTENDED)


def test_hints_without_lengths_are_written_in_polygraphy_format_only(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    write_hints(str(path), HINTS)
    assert path.read_text() == dumps(HINTS) == hints_text(HINTS)
    assert "shardcheck_extension" not in path.read_text()
    # The Polygraphy document holds no trace of the extension even for extended hints.
    assert dumps(EXTENDED) == dumps(HINTS)


def test_the_extension_sits_beside_its_hints() -> None:
    assert extension_path("out/h.json") == "out/h.shardcheck.json"
    assert extension_path("hints") == "hints.shardcheck.json"


@pytest.mark.parametrize(
    ("changes", "path", "problem"),
    [
        ({"version": 2}, "version", "version 2 is not one this shardcheck reads (1)"),
        ({"shardcheck_extension": "other"}, "shardcheck_extension", "expected 'lengths'"),
        ({"extra": 1}, "extra", "unknown key"),
        ({"rank_length": ["view", "view"]}, "rank_length", 'names node "view" twice'),
        ({"rank_length": "view"}, "rank_length", "expected a list of node names"),
        ({"whole_length": ["view"]}, "rank_length", '"view" is in whole_length too'),
    ],
)
def test_a_bad_field_is_an_error_naming_it(
    changes: dict[str, object], path: str, problem: str
) -> None:
    with pytest.raises(HintsFormatError) as caught:
        loads_hints_or_extension(json.dumps(document(**changes)), "e.json")
    assert caught.value.path == path
    assert problem in caught.value.message
    assert caught.value.message.startswith(f"e.json: {path}: ")


def test_the_hints_inside_are_checked_as_a_hints_file_is() -> None:
    bad = encode(HINTS)
    bad["inputs"][0]["seq_len_idx"] = "1"  # type: ignore[index]
    with pytest.raises(HintsFormatError) as caught:
        loads_hints_or_extension(json.dumps(document(hints=bad)), "e.json")
    assert caught.value.path == "inputs[0].seq_len_idx"


def test_a_key_given_twice_is_refused() -> None:
    text = json.dumps(document()).replace('"version": 1', '"version": 1, "version": 1')
    with pytest.raises(HintsFormatError, match="version: key given twice"):
        loads_hints_or_extension(text, "e.json")
