"""``shardcheck diff``: what counts as a difference, and how it is shown."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import GOLDEN, run_cli

from shardcheck.errors import HintsFormatError
from shardcheck.hints.codec import dumps, encode
from shardcheck.hints.diff import diff_hints
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import AttentionLayerHint, ShardHints, ShardTensor

# Two layers (q, q2), six inputs, two outputs: enough entries for order to matter.
BASE = ShardHints(
    attention_layers=(
        AttentionLayerHint("q", gather_kv=True, gather_q=False),
        AttentionLayerHint("q2", gather_kv=True, gather_q=False),
    ),
    inputs=(
        ShardTensor("q", 1, 3),
        ShardTensor("k", 2, 3),
        ShardTensor("v", 1, 3),
        ShardTensor("q2", 0, None),
        ShardTensor("k2", 0, None),
        ShardTensor("v2", 0, None),
    ),
    outputs=(ShardTensor("out1", 1, 3), ShardTensor("out2", 0, None)),
    kv_rank=3,
)


def write(path: Path, hints: ShardHints) -> Path:
    path.write_text(dumps(hints))
    return path


def reordered(hints: ShardHints) -> ShardHints:
    return hints.with_changes(
        inputs=hints.inputs[::-1],
        outputs=hints.outputs[::-1],
        attention_layers=hints.attention_layers[::-1],
    )


def with_input_axis(hints: ShardHints, name: str, seq_len_idx: int) -> ShardHints:
    inputs = tuple(
        replace(t, seq_len_idx=seq_len_idx) if t.name == name else t for t in hints.inputs
    )
    return hints.with_changes(inputs=inputs)


def with_output_renamed(hints: ShardHints, old: str, new: str) -> ShardHints:
    outputs = tuple(replace(t, name=new) if t.name == old else t for t in hints.outputs)
    return hints.with_changes(outputs=outputs)


def without_layer(hints: ShardHints, q: str) -> ShardHints:
    return hints.with_changes(attention_layers=tuple(x for x in hints.attention_layers if x.q != q))


def with_reduce_op(hints: ShardHints, reduce_op: str) -> ShardHints:
    return hints.with_changes(dist_collectives=replace(hints.dist_collectives, reduce_op=reduce_op))


def flat_document(hints: ShardHints) -> dict[str, object]:
    """The same hints in TensorRT 10.14's flat layout (collectives at top level)."""
    document = encode(hints)
    dist = document.pop("dist_collectives")
    document.update(
        group_size=dist["group_size"],
        root=dist["root"],
        groups=dist["groups"],
        nb_rank=dist["nb_rank"],
        reduce_scatter_reduce_op=dist["reduce_op"],
    )
    for layer in document["attention_layers"]:
        del layer["replace"]
    return document


# In BASE, input k has seq_len_idx 2; output out1 is (seq_len_idx 1, rank 3).
SINGLE_CHANGES = {
    "seq_len_idx": (
        with_input_axis(BASE, "k", 0),
        ["inputs[name=k].seq_len_idx: 2 -> 0"],
    ),
    "renamed tensor": (
        with_output_renamed(BASE, "out1", "hidden"),
        [
            'outputs[name=hidden]: added {"rank": 3, "seq_len_idx": 1}',
            'outputs[name=out1]: removed (was {"rank": 3, "seq_len_idx": 1})',
        ],
    ),
    "removed layer": (
        without_layer(BASE, "q2"),
        [
            "attention_layers[q=q2]: removed "
            '(was {"gather_kv": true, "gather_q": false, "replace": null})'
        ],
    ),
    "reduce_op": (
        with_reduce_op(BASE, "sum"),
        ['dist_collectives.reduce_op: "max" -> "sum"'],
    ),
}


def test_reordered_inputs_outputs_and_layers_are_equal(tmp_path: Path) -> None:
    golden = write(tmp_path / "golden.json", BASE)
    candidate = write(tmp_path / "candidate.json", reordered(BASE))
    assert candidate.read_text() != golden.read_text()

    result = run_cli("diff", golden, candidate)

    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.parametrize("change", SINGLE_CHANGES, ids=str)
def test_each_change_is_named_on_its_own_line(tmp_path: Path, change: str) -> None:
    candidate_hints, expected_lines = SINGLE_CHANGES[change]
    golden = write(tmp_path / "golden.json", BASE)
    candidate = write(tmp_path / "candidate.json", reordered(candidate_hints))

    result = run_cli("diff", golden, candidate)

    assert result.exit_code == 1
    assert result.stdout.splitlines() == expected_lines
    assert result.stderr == ""


def test_all_changes_at_once_one_line_each_added_removed_changed(tmp_path: Path) -> None:
    candidate_hints = with_reduce_op(
        without_layer(with_output_renamed(with_input_axis(BASE, "k", 0), "out1", "hidden"), "q2"),
        "sum",
    )
    golden = write(tmp_path / "golden.json", BASE)
    candidate = write(tmp_path / "candidate.json", candidate_hints)

    result = run_cli("diff", golden, candidate)

    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        'outputs[name=hidden]: added {"rank": 3, "seq_len_idx": 1}',
        "attention_layers[q=q2]: removed "
        '(was {"gather_kv": true, "gather_q": false, "replace": null})',
        'outputs[name=out1]: removed (was {"rank": 3, "seq_len_idx": 1})',
        'dist_collectives.reduce_op: "max" -> "sum"',
        "inputs[name=k].seq_len_idx: 2 -> 0",
    ]
    assert result.stderr == ""


@pytest.mark.parametrize("old_first", [True, False], ids=["old-vs-new", "new-vs-old"])
def test_old_flat_format_equals_new_format_of_the_same_hints(
    tmp_path: Path, old_first: bool
) -> None:
    hints = BASE.with_changes(
        dist_collectives=replace(
            BASE.dist_collectives, group_size=4, root=0, groups=(0, 1), reduce_op="sum"
        )
    )
    old = tmp_path / "old.json"
    old.write_text(json.dumps(flat_document(hints), indent=2))
    new = write(tmp_path / "new.json", hints)
    assert "dist_collectives" not in json.loads(old.read_text())

    result = run_cli("diff", *((old, new) if old_first else (new, old)))

    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")


def test_old_flat_format_differences_are_still_found(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps(flat_document(BASE)))
    new = write(tmp_path / "new.json", with_reduce_op(BASE, "min"))

    result = run_cli("diff", old, new)

    assert result.exit_code == 1
    assert result.stdout == 'dist_collectives.reduce_op: "max" -> "min"\n'


def test_json_format(tmp_path: Path) -> None:
    golden = write(tmp_path / "golden.json", BASE)
    candidate = write(tmp_path / "candidate.json", with_input_axis(BASE, "k", 0))

    result = run_cli("diff", "--format", "json", golden, candidate)

    assert result.exit_code == 1
    assert result.stderr == ""
    assert json.loads(result.stdout) == {
        "ok": False,
        "golden": str(golden),
        "candidate": str(candidate),
        "equal": False,
        "differences": [
            {
                "kind": "changed",
                "path": "inputs[name=k].seq_len_idx",
                "golden": 2,
                "candidate": 0,
            }
        ],
    }


def test_json_format_when_equal(tmp_path: Path) -> None:
    golden = write(tmp_path / "golden.json", BASE)
    candidate = write(tmp_path / "candidate.json", reordered(BASE))

    result = run_cli("diff", "--format", "json", golden, candidate)

    assert result.exit_code == 0
    assert json.loads(result.stdout)["equal"] is True
    assert json.loads(result.stdout)["differences"] == []


def test_ignore_drops_the_named_paths_and_wildcards(tmp_path: Path) -> None:
    candidate_hints = with_reduce_op(
        with_output_renamed(with_input_axis(BASE, "k", 0), "out1", "hidden"), "sum"
    )
    golden = write(tmp_path / "golden.json", BASE)
    candidate = write(tmp_path / "candidate.json", candidate_hints)

    result = run_cli(
        "diff",
        golden,
        candidate,
        "--ignore",
        "dist_collectives.reduce_op",
        "--ignore",
        "inputs[*].seq_len_idx",
    )

    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        'outputs[name=hidden]: added {"rank": 3, "seq_len_idx": 1}',
        'outputs[name=out1]: removed (was {"rank": 3, "seq_len_idx": 1})',
    ]


def test_ignoring_every_difference_exits_0(tmp_path: Path) -> None:
    golden = write(tmp_path / "golden.json", BASE)
    candidate_hints = with_reduce_op(BASE, "avg").with_changes(
        inputs=(*BASE.inputs, ShardTensor("extra", 1, 2))
    )
    candidate = write(tmp_path / "candidate.json", candidate_hints)

    result = run_cli(
        "diff", golden, candidate, "--ignore", "dist_collectives", "--ignore", "inputs"
    )

    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")


def test_renaming_the_only_entry_is_removed_plus_added(tmp_path: Path) -> None:
    golden = write(tmp_path / "g.json", ShardHints(outputs=(ShardTensor("out1", 1, 3),)))
    candidate = write(tmp_path / "c.json", ShardHints(outputs=(ShardTensor("hidden", 1, 3),)))
    result = run_cli("diff", golden, candidate)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        'outputs[name=hidden]: added {"rank": 3, "seq_len_idx": 1}',
        'outputs[name=out1]: removed (was {"rank": 3, "seq_len_idx": 1})',
    ]


def test_emptying_a_collection_names_each_removed_entry(tmp_path: Path) -> None:
    golden = write(tmp_path / "g.json", BASE.with_changes(outputs=()))
    candidate = write(tmp_path / "c.json", BASE.with_changes(outputs=(), inputs=()))
    result = run_cli("diff", golden, candidate)
    assert result.exit_code == 1
    assert len(result.stdout.splitlines()) == 6
    assert all(": removed (was " in line for line in result.stdout.splitlines())


def test_hints_made_in_python_with_a_tensor_twice_are_refused_not_half_compared() -> None:
    golden = read_hints(GOLDEN / "attention_head.json")
    twice = golden.with_changes(inputs=(ShardTensor("input", 2, 3), *golden.inputs))
    with pytest.raises(HintsFormatError, match=r"^candidate: inputs\[1\].name"):
        diff_hints(golden, twice)


def test_one_ignore_pattern_may_be_given_as_a_string() -> None:
    golden = read_hints(GOLDEN / "attention_head.json")
    changed = golden.with_changes(kv_rank=4)
    assert [d.path for d in diff_hints(golden, changed)] == ["kv_rank"]
    assert diff_hints(golden, changed, ignore="kv_rank") == []
