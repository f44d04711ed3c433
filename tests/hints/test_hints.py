from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardcheck.errors import HintsFormatError
from shardcheck.hints.codec import decode, dumps, encode, loads, validated
from shardcheck.hints.files import write_hints
from shardcheck.hints.model import (
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
    ShardTensor,
)

FULL = ShardHints(
    parallelism="CP",
    attention_layers=(
        AttentionLayerHint("q0", gather_kv=True, gather_q=False),
        AttentionLayerHint(
            "q1",
            gather_kv=False,
            gather_q=False,
            replace=FusedAttention(True, (0, 2, 1, 3), None, (0, 2, 1, 3), nb_rank=2),
        ),
    ),
    dist_collectives=DistCollective(
        group_size=4, root=0, nb_rank=2, groups=(0, 1), reduce_op="sum"
    ),
    inputs=(ShardTensor("input_ids", 1, 2), ShardTensor("mask", 1, None)),
    outputs=(ShardTensor("hidden", 1, 3),),
    k_seq_len_idx=3,
    v_seq_len_idx=2,
    kv_rank=4,
)

# TensorRT 10.14's Polygraphy wrote the collective settings at top level.
FLAT = {
    "parallelism": "CP",
    "attention_layers": [
        {"q": "q0", "gather_kv": True, "gather_q": False, "polygraphy_class": "AttentionLayerHint"}
    ],
    "group_size": 4,
    "root": 0,
    "groups": [0, 1],
    "reduce_scatter_reduce_op": "sum",
    "inputs": [
        {"name": "input_ids", "seq_len_idx": 1, "rank": 2, "polygraphy_class": "ShardTensor"}
    ],
    "outputs": [{"name": "hidden", "seq_len_idx": 1, "rank": 3, "polygraphy_class": "ShardTensor"}],
    "k_seq_len_idx": 3,
    "v_seq_len_idx": 2,
    "kv_rank": 4,
    "polygraphy_class": "ShardHints",
}


def test_round_trip_keeps_everything() -> None:
    assert loads(dumps(FULL)) == FULL


def test_written_document_has_polygraphy_keys_nesting_and_tags() -> None:
    document = json.loads(dumps(FULL))
    assert list(document) == [
        "parallelism",
        "attention_layers",
        "dist_collectives",
        "inputs",
        "outputs",
        "k_seq_len_idx",
        "v_seq_len_idx",
        "kv_rank",
        "polygraphy_class",
    ]
    assert document["polygraphy_class"] == "ShardHints"
    assert document["dist_collectives"] == {
        "group_size": 4,
        "root": 0,
        "nb_rank": 2,
        "reduce_op": "sum",
        "groups": [0, 1],
        "polygraphy_class": "DistCollective",
    }
    assert document["attention_layers"][0] == {
        "q": "q0",
        "gather_kv": True,
        "gather_q": False,
        "replace": None,
        "polygraphy_class": "AttentionLayerHint",
    }
    assert document["attention_layers"][1]["replace"] == {
        "is_causal": True,
        "q_shuffle": [0, 2, 1, 3],
        "k_shuffle": None,
        "v_shuffle": [0, 2, 1, 3],
        "nb_rank": 2,
        "polygraphy_class": "FusedAttention",
    }
    assert document["inputs"][1] == {
        "name": "mask",
        "seq_len_idx": 1,
        "rank": None,
        "polygraphy_class": "ShardTensor",
    }


def test_dumps_is_four_space_indented_with_final_newline() -> None:
    text = dumps(FULL)
    assert text.endswith("}\n")
    assert text.splitlines()[1].startswith('    "parallelism"')


def test_flat_format_loads_into_the_same_model_and_saves_as_new() -> None:
    hints = decode(FLAT, "old.json")
    assert hints.dist_collectives == DistCollective(4, 0, 1, (0, 1), "sum")
    assert hints.attention_layers == (AttentionLayerHint("q0", True, False, None),)
    saved = json.loads(dumps(hints))
    assert "dist_collectives" in saved and "group_size" not in saved
    assert saved["dist_collectives"]["reduce_op"] == "sum"
    assert decode(saved) == hints


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda d: d["inputs"][0].update(seq_len_idx="1"),
            'h.json: inputs[0].seq_len_idx: expected an integer, got "1"',
        ),
        (
            lambda d: d["inputs"][0].update(seq_len_idx=True),
            "h.json: inputs[0].seq_len_idx: expected an integer, got true",
        ),
        (
            lambda d: d["inputs"][0].update(seq_len_idx=-1),
            "h.json: inputs[0].seq_len_idx: expected an integer between 0 and 63, got -1",
        ),
        (
            lambda d: d["inputs"][0].update(seq_len_idx=10**30),
            "h.json: inputs[0].seq_len_idx: expected an integer between 0 and 63",
        ),
        (
            lambda d: d["attention_layers"][1].update(gather_kv="yes"),
            'h.json: attention_layers[1].gather_kv: expected true or false, got "yes"',
        ),
        (
            lambda d: d["dist_collectives"].update(reduce_op="mean"),
            "h.json: dist_collectives.reduce_op: expected one of "
            "'sum', 'prod', 'min', 'max', 'avg'",
        ),
        (
            lambda d: d["attention_layers"][1]["replace"].update(polygraphy_class="os.system"),
            "h.json: attention_layers[1].replace.polygraphy_class: expected 'FusedAttention', "
            'got "os.system"',
        ),
        (
            lambda d: d["outputs"][0].pop("polygraphy_class"),
            "h.json: outputs[0]: missing 'polygraphy_class' (expected 'ShardTensor')",
        ),
        (lambda d: d["outputs"][0].pop("name"), "h.json: outputs[0].name: missing required field"),
        (
            lambda d: d["outputs"][0].update(seq_len_index=1),
            "h.json: outputs[0].seq_len_index: unknown key in ShardTensor",
        ),
        (lambda d: d.update(inputs={"name": "x"}), "h.json: inputs: expected a list"),
        (
            lambda d: d["inputs"].append(dict(d["inputs"][0])),
            "h.json: inputs[2].name: duplicate tensor 'input_ids' (also at inputs[0].name)",
        ),
        (lambda d: d.update(kv_rank=0), "h.json: kv_rank: expected an integer between 1 and 64"),
        (lambda d: d.update(parallelism="DP"), "h.json: parallelism: expected one of 'CP', 'TP'"),
    ],
)
def test_wrong_fields_name_file_and_json_path(mutate, message: str) -> None:
    document = encode(FULL)
    mutate(document)
    with pytest.raises(HintsFormatError) as caught:
        decode(json.loads(json.dumps(document)), "h.json")
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_invalid_json_and_wrong_top_level() -> None:
    with pytest.raises(HintsFormatError, match=r"^h.json: not valid JSON \(Expecting"):
        loads("{", "h.json")
    # json's message ends where the position goes: one "at", not two.
    with pytest.raises(HintsFormatError) as unterminated:
        loads('{"parallelism": "CP', "h.json")
    assert str(unterminated.value) == (
        "h.json: not valid JSON (Unterminated string starting at line 1 column 17)"
    )
    with pytest.raises(HintsFormatError, match=r"^h.json: not valid JSON .*NaN"):
        loads('{"kv_rank": NaN}', "h.json")
    with pytest.raises(HintsFormatError, match=r"^h.json: expected a JSON object"):
        loads("[1, 2]", "h.json")
    # Python's json (Polygraphy's reader) refuses it too; say what to do about it.
    with pytest.raises(HintsFormatError, match=r"^h.json: starts with a byte-order mark \(BOM\)"):
        loads("\ufeff" + dumps(ShardHints()), "h.json")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"kv_rank": 0}, "kv_rank: expected an integer between 1 and 64, got 0"),
        (
            {"inputs": (ShardTensor("x", -1, 3),)},
            "inputs[0].seq_len_idx: expected an integer between 0 and 63, got -1",
        ),
        ({"inputs": (ShardTensor("x", True),)}, "inputs[0].seq_len_idx: expected an integer"),
        ({"inputs": (ShardTensor("x", 1.0),)}, "inputs[0].seq_len_idx: expected an integer"),
        ({"inputs": None}, "inputs: expected a list, got null"),
        (
            {"dist_collectives": None},
            "dist_collectives: expected a DistCollective object, got null",
        ),
    ],
)
def test_hints_made_in_python_are_refused_where_a_file_of_them_would_be(
    tmp_path: Path, change: dict[str, Any], problem: str
) -> None:
    made = ShardHints().with_changes(**change)
    with pytest.raises(HintsFormatError) as error:
        validated(made, "made")
    assert error.value.message.startswith(f"made: {problem}")
    # Nothing is written that the reader would refuse.
    with pytest.raises(HintsFormatError):
        write_hints(str(tmp_path / "h.json"), made)
    assert list(tmp_path.iterdir()) == []
