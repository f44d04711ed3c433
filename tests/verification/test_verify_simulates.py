"""verify proves by default: the CP simulation is part of every verify (2 ranks unless the hints'
nb_rank or --ranks says otherwise), --no-simulate skips it, and what it could not prove is said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, GOLDEN, read_json, run_cli, simulated_lengths

from shardcheck.errors import InputError
from shardcheck.hints.files import read_hints
from shardcheck.verification.verify import default_ranks, verify

REAL = FIXTURES / "real"
GPT2 = REAL / "ts_gpt2_tiny.onnx"
GPT2_HINTS = GOLDEN / "real" / "ts_gpt2_tiny.json"


@pytest.fixture
def graph_cut_hints(tmp_path: Path) -> Path:
    """Polygraphy's cut of GPT-2 (its graph inputs): every axis fits, but each rank counts its
    positions from 0 (a Range of its local length), which only the simulation shows."""
    path = tmp_path / "graph.json"
    assert run_cli("gen", GPT2, "--io", "graph", "-o", path).exit_code == 0
    return path


def test_plain_verify_simulates_on_2_ranks_at_each_length() -> None:
    report = verify(GPT2, GPT2_HINTS)
    assert report.ok, report.render_text()
    assert simulated_lengths(report) == [(8, True), (16, True)]
    assert {run["ranks"] for run in report.runs if run.get("simulation")} == {2}


def test_a_length_the_inputs_fix_is_simulated_once_and_said_so(tmp_path: Path) -> None:
    # DeiT's 16 positions are its image's patches: --seq-lens 8,16 change nothing, so one
    # simulation proves it, and the message names no length it did not run at.
    model = REAL / "ts_deit_tiny.onnx"
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints, "-q").exit_code == 0
    report = verify(model, hints)
    assert report.ok, report.render_text()
    runs = [run for run in report.runs if run.get("simulation")]
    assert len(runs) == 1 and runs[0]["length_fixed"] is True
    [message] = [f.message for f in report.findings if f.code == "SC202"]
    assert message.startswith("2 simulated ranks at the length its inputs fix match")


def test_plain_verify_fails_hints_whose_axes_fit_but_whose_split_run_differs(
    graph_cut_hints: Path,
) -> None:
    unsimulated = verify(GPT2, graph_cut_hints, simulate=False)
    assert unsimulated.ok, unsimulated.render_text()  # the axis checks alone pass them
    plain = run_cli("verify", GPT2, graph_cut_hints)
    assert plain.exit_code == 1, plain.stdout
    [mismatch] = [line for line in plain.stdout.splitlines() if line.startswith("SC201 error:")]
    assert "first difference on rank 1 at tensor '/model/Range_output_0'" in mismatch
    assert plain.stdout.splitlines()[-1].startswith("FAIL: 1 error(s)")


def test_no_simulate_skips_the_simulation_and_its_help_says_what_is_left_unproved(
    graph_cut_hints: Path,
) -> None:
    result = run_cli("verify", GPT2, graph_cut_hints, "--no-simulate", "--format", "json")
    assert result.exit_code == 0, result.stdout
    document = json.loads(result.stdout)
    assert not [run for run in document["runs"] if run.get("simulation")]
    help_text = " ".join(run_cli("verify", "--help").stdout.split())
    assert (
        "--no-simulate Skip the CP simulation. Then only the axes, ranks and layers are "
        "checked: nothing proves that the hints give the single-device result when the model "
        "runs split."
    ) in help_text


def test_ranks_and_no_simulate_together_are_bad_input() -> None:
    result = run_cli("verify", GPT2, GPT2_HINTS, "--ranks", "2", "--no-simulate")
    assert result.exit_code == 2
    assert result.stderr == (
        "shardcheck: error: --ranks 2 and --no-simulate: --ranks is the number of ranks the "
        "simulation runs on; give one of the two\n"
    )


def test_default_ranks_are_the_hints_nb_rank_above_1_else_2(tmp_path: Path) -> None:
    hints = read_hints(GPT2_HINTS)
    assert hints.dist_collectives.nb_rank == 1 and default_ranks(hints) == 2
    document = read_json(GPT2_HINTS)
    document["dist_collectives"]["nb_rank"] = 4
    path = tmp_path / "four.json"
    path.write_text(json.dumps(document))
    assert default_ranks(read_hints(path)) == 4
    document["dist_collectives"].update(nb_rank=1, groups=[0, 1, 2])  # the ranks of a group
    path.write_text(json.dumps(document))
    assert default_ranks(read_hints(path)) == 3
    document["dist_collectives"].update(groups=[], group_size=4)
    path.write_text(json.dumps(document))
    assert default_ranks(read_hints(path)) == 4
    report = verify(GPT2, path)
    assert report.ok, report.render_text()
    assert {run["ranks"] for run in report.runs if run.get("simulation")} == {4}


def test_lengths_that_do_not_split_are_a_warning_by_default_and_bad_input_with_ranks() -> None:
    report = verify(GPT2, GPT2_HINTS, seq_lens=(9, 18))
    assert report.ok and simulated_lengths(report) == []
    [warning] = [f for f in report.findings if f.code == "SC204"]
    assert (warning.level, warning.message) == (
        "warning",
        "the CP simulation on 2 ranks did not run (every sequence length must be a multiple "
        "of the number of ranks (9 is not)), so nothing shows that these hints give the "
        "single-device result when the model runs split: give --seq-lens whose scattered axes "
        "divide by 2, or --ranks",
    )
    strict = run_cli("verify", GPT2, GPT2_HINTS, "--seq-lens", "9,18", "--strict")
    assert strict.exit_code == 1, strict.stdout
    with pytest.raises(InputError, match=r"^--ranks 2: every sequence length must be a multiple"):
        verify(GPT2, GPT2_HINTS, seq_lens=(9, 18), ranks=2)


def test_a_replacement_that_drops_the_padding_mask_fails_the_simulation_at_batch_2(
    tmp_path: Path,
) -> None:
    # BERT's layers add a padding mask to their scores; a fused attention takes none (SC128
    # says so from the graph). With a batch of 2 the feeds pad row 1, so the simulation shows
    # it too; at batch 1 the mask is all ones and dropping it changes nothing.
    bert = REAL / "ts_bert_tiny.onnx"
    gen = tmp_path / "native.json"
    assert run_cli("gen", bert, "--nb-rank", "2", "-o", gen).exit_code == 0
    document = read_json(gen)
    for layer in document["attention_layers"]:
        layer["replace"] = {
            "is_causal": False,
            "q_shuffle": None,
            "k_shuffle": [0, 1, 3, 2],  # K enters the scores as [batch, heads, head, keys]
            "v_shuffle": None,
            "nb_rank": 2,
            "polygraphy_class": "FusedAttention",
        }
    fused = tmp_path / "fused.json"
    fused.write_text(json.dumps(document))
    at_batch_1 = verify(bert, fused)
    assert {f.code for f in at_batch_1.errors} == {"SC128"}, at_batch_1.render_text()
    assert simulated_lengths(at_batch_1) == [(8, True), (16, True)]
    at_batch_2 = verify(bert, fused, dims={"batch": 2})
    assert {f.code for f in at_batch_2.errors} == {"SC128", "SC201"}, at_batch_2.render_text()
    assert simulated_lengths(at_batch_2) == [(8, False)]


def test_plain_verify_refuses_a_null_rank_it_needs_and_says_what_to_write(tmp_path: Path) -> None:
    # No rule knows Hardmax's shape (and the model declares none for its output): gen would
    # write rank null. Scattering it along axis 1 takes its rank, to swap the axis to the front.
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [
            helper.make_node("Hardmax", ["x"], ["h"], name="hardmax", axis=0),
            helper.make_node("Identity", ["h"], ["y"], name="out"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "sequence"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "sequence"])],
    )
    model = tmp_path / "hardmax.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    hints = tmp_path / "null_rank.json"
    tensor = {"seq_len_idx": 1, "polygraphy_class": "ShardTensor"}
    document = read_json(GPT2_HINTS)  # its collectives; no layers
    document["attention_layers"] = []
    document["inputs"] = [{"name": "h", "rank": None, **tensor}]
    document["outputs"] = [{"name": "y", "rank": 2, **tensor}]
    hints.write_text(json.dumps(document))
    result = run_cli("verify", model, hints)
    assert result.exit_code == 1, result.stdout
    assert (
        "SC203 error: the CP simulation on 2 ranks cannot shard the model with these hints: "
        f"{hints}: inputs[0]: seq_len_idx 1 needs the rank of 'h', but the model declares no "
        "shape for it and the hint gives no rank: write its number of axes as the hint's rank"
    ) in result.stdout.splitlines()
