"""gen's extension file beside the hints, explain's two plans, and the commands that read it
(issue 27, item 2)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURES, run_cli

from shardcheck import load_index
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

LLAMA = FIXTURES / "real" / "dynamo_llama_tiny_gqa.onnx"


def test_gen_writes_the_extension_and_says_how_much_each_plan_splits(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    result = run_cli("gen", LLAMA, "-o", hints)
    assert result.exit_code == 0, result.stderr
    extension = tmp_path / "h.shardcheck.json"
    assert extension.exists()
    # The dynamo exporter sizes every head split by attention_mask.shape[1]: the hints' cut is
    # inside the layers, the extension's at the token ids (every projection on slices).
    assert (
        f"shardcheck: {hints}: Polygraphy-compatible hints: 0.0% of the projection and MLP "
        f"FLOPs on slices; 'shardcheck shard' with the extension {extension}: 100.0%\n"
    ) in result.stderr
    extended = read_hints(extension)
    assert extended.lengths is not None and extended.lengths.rank
    # Scattered: the token ids, the causal mask (along its queries) and the rotary cos and
    # sin tables, each computed whole on every rank.
    assert [(t.name, t.seq_len_idx) for t in extended.inputs] == [
        ("input_ids", 1),
        ("bitwise_and", 2),
        ("unsqueeze_14", 2),
        ("unsqueeze_15", 2),
    ]
    assert [t.name for t in extended.outputs] == ["last_hidden_state"]
    assert read_hints(hints).lengths is None


def test_quiet_prints_no_line_but_writes_the_extension(tmp_path: Path) -> None:
    result = run_cli("gen", LLAMA, "-o", tmp_path / "h.json", "-q")
    assert result.exit_code == 0 and result.stderr == ""
    assert (tmp_path / "h.shardcheck.json").exists()


def test_no_extension_with_compat_or_graph_io_or_when_told(tmp_path: Path) -> None:
    for options in (["--compat", "polygraphy"], ["--io", "graph"], ["--no-extension"]):
        hints = tmp_path / "h.json"
        result = run_cli("gen", LLAMA, "-o", hints, *options)
        assert result.exit_code == 0, result.stderr
        assert not (tmp_path / "h.shardcheck.json").exists(), options
        assert "extension" not in result.stderr


def test_to_stdout_the_line_says_nothing_was_written(tmp_path: Path) -> None:
    result = run_cli("gen", LLAMA, "-o", "-")
    assert result.exit_code == 0
    assert "with the extension: 100.0% (not written beside -)" in result.stderr
    assert "shardcheck_extension" not in result.stdout


def test_json_reports_the_extension_file_and_both_shares(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    result = run_cli("gen", LLAMA, "-o", hints, "--format", "json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)["extension"]
    assert report["file"] == str(tmp_path / "h.shardcheck.json")
    assert report["hints"]["projections_on_slices"] == 0.0
    assert report["extension"]["projections_on_slices"] == 1.0
    alone = run_cli("gen", LLAMA, "-o", hints, "--format", "json", "--no-extension")
    assert json.loads(alone.stdout)["extension"] is None


def test_a_stale_extension_is_removed_and_a_file_not_ours_is_left(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    assert run_cli("gen", LLAMA, "-o", hints, "-q").exit_code == 0
    sdpa = FIXTURES / "real" / "ts_sdpa.onnx"  # split whole by the Polygraphy format
    result = run_cli("gen", sdpa, "-o", hints)
    assert result.exit_code == 0
    assert not (tmp_path / "h.shardcheck.json").exists()
    assert f"{tmp_path / 'h.shardcheck.json'}: removed" in result.stderr
    mine = tmp_path / "h.shardcheck.json"
    mine.write_text('{"notes": "mine"}\n')
    for model in (sdpa, LLAMA):
        result = run_cli("gen", model, "-o", hints)
        assert result.exit_code == 0
        assert mine.read_text() == '{"notes": "mine"}\n'
    assert "not a shardcheck extension file; left as it is" in result.stderr


def test_explain_counts_the_extension_gen_writes_and_both_plans(tmp_path: Path) -> None:
    result = run_cli("explain", LLAMA, "--format", "json")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["plans"]["written"] == "extension"
    assert document["plans"]["hints"]["projections_on_slices"] == 0.0
    assert document["plans"]["extension"]["projections_on_slices"] == 1.0
    assert document["plan"]["flops"]["by_class"]["projections"]["share_on_slices"] == 1.0
    text = run_cli("explain", LLAMA).stdout
    assert "plans: Polygraphy-compatible hints: 0.0% of the projection and MLP" in text
    # Hints given: their plan only, the extension file named as such.
    hints = tmp_path / "h.json"
    assert run_cli("gen", LLAMA, "-o", hints, "-q").exit_code == 0
    given = json.loads(run_cli("explain", LLAMA, hints, "--format", "json").stdout)
    assert given["plans"] is None
    assert given["plan"]["flops"]["by_class"]["projections"]["share_on_slices"] == 0.0
    extension = tmp_path / "h.shardcheck.json"
    named = json.loads(run_cli("explain", LLAMA, extension, "--format", "json").stdout)
    assert named["plan"]["hints"] == f"{extension} (shardcheck's extension)"


def test_shard_simulate_diff_and_fmt_read_the_extension(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    assert run_cli("gen", LLAMA, "-o", hints, "-q").exit_code == 0
    extension = tmp_path / "h.shardcheck.json"
    out = tmp_path / "md.onnx"
    assert run_cli("shard", LLAMA, extension, "-o", out).exit_code == 0
    # The shard gives the reshapes a rank's length: the model holds the scaling Mul/Div.
    assert b"rank_length" in out.read_bytes()
    simulated = run_cli("simulate", LLAMA, extension, "--ranks", 4, "--seq-len", 16, "-q")
    assert simulated.exit_code == 0, simulated.stdout
    diff = run_cli("diff", hints, extension)
    assert diff.exit_code == 1
    assert "lengths: added" in diff.stdout and "inputs[name=input_ids]: added" in diff.stdout
    assert run_cli("fmt", "--check", extension).exit_code == 0
    assert run_cli("fmt", extension, "-o", tmp_path / "copy.json").exit_code == 0
    assert (tmp_path / "copy.json").read_text() == extension.read_text()


def test_shard_refuses_a_node_the_model_does_not_have(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    assert run_cli("gen", LLAMA, "-o", hints, "-q").exit_code == 0
    extension = tmp_path / "h.shardcheck.json"
    document = json.loads(extension.read_text())
    document["rank_length"].append("no_such_node")
    extension.write_text(json.dumps(document))
    result = run_cli("shard", LLAMA, extension, "-o", tmp_path / "md.onnx")
    assert result.exit_code == 2
    assert result.stderr == (
        f"shardcheck: error: {extension}: rank_length[16]: 'no_such_node' is not a node of "
        f"the model {LLAMA}\n"
    )


def test_the_extension_lowers_no_figure_of_the_plan() -> None:
    # Its plan, as explain counts it, runs more on slices than the hints' in every class.
    index = load_index(LLAMA)
    from shardcheck import GenOptions, generate

    generated = generate(index, GenOptions())
    assert generated.extension is not None
    plain, extended = make_plan(index, generated.hints), make_plan(index, generated.extension.hints)
    for name in ("attention", "projections", "other"):
        assert extended.classes[name].share_on_slices >= plain.classes[name].share_on_slices
    assert extended.speedup_bound > plain.speedup_bound
