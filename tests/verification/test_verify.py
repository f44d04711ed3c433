"""``shardcheck verify``: right hints pass; each single mistake is caught, naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import (
    ANCHORS,
    FIXTURES,
    GOLDEN,
    attention_model,
    read_json,
    run_cli,
    simulated_lengths,
)
from onnx import TensorProto, helper, numpy_helper

from shardcheck import GraphIndex, verify
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import HintsFormatError, InputError, ModelError
from shardcheck.graph.loader import load_index
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import AttentionLayerHint, DistCollective, ShardHints, ShardTensor
from shardcheck.simulation.simulate import first_unsplittable
from shardcheck.verification.findings import ERROR, INFO, WARNING

REAL = FIXTURES / "real"
BAKED_MHA = read_json(REAL / "TRUTH.json")["ts_mha_seq_first"]["baked_length_nodes"][0]["node"]
BERT = REAL / "ts_bert_tiny.onnx"


@pytest.fixture(scope="module")
def bert_hints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bert") / "hints.json"
    assert run_cli("gen", BERT, "-o", out).exit_code == 0
    return read_json(out)


def errors(report: Any) -> list[tuple[str, str]]:
    return [(f.code, f.field) for f in report.errors]


def test_right_hints_pass_with_exit_0(bert_hints: dict[str, Any], tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    hints.write_text(json.dumps(bert_hints))
    result = run_cli("verify", BERT, hints)
    assert result.exit_code == 0, result.stdout
    assert result.stdout.splitlines()[-1].startswith("PASS: 0 error(s)")
    # attention_mask is a padding mask over the keys: left whole, and said so.
    assert "SC119" in result.stdout


def test_hand_written_hints_from_the_truth_pass(tmp_path: Path) -> None:
    # ts_sdpa: x [batch, seq, 32] -> heads [batch, 2, seq, 16]; K enters the score MatMul as
    # [batch, 2, 16, seq] (index 3), V as [batch, 2, seq, 16] (index 2). Written by hand.
    hints = {
        "parallelism": "CP",
        "attention_layers": [
            {
                "q": "/Mul_output_0",
                "gather_kv": True,
                "gather_q": False,
                "replace": None,
                "polygraphy_class": "AttentionLayerHint",
            }
        ],
        "dist_collectives": {
            "group_size": 0,
            "root": -1,
            "nb_rank": 1,
            "reduce_op": "max",
            "groups": [],
            "polygraphy_class": "DistCollective",
        },
        "inputs": [{"name": "x", "seq_len_idx": 1, "rank": 3, "polygraphy_class": "ShardTensor"}],
        "outputs": [{"name": "y", "seq_len_idx": 1, "rank": 3, "polygraphy_class": "ShardTensor"}],
        "k_seq_len_idx": 3,
        "v_seq_len_idx": 2,
        "kv_rank": 4,
        "polygraphy_class": "ShardHints",
    }
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hints))
    report = verify(REAL / "ts_sdpa.onnx", path, ranks=2)
    assert report.ok, report.render_text()
    assert [f.code for f in report.findings] == ["SC202", "SC202"]


def _input(name_end: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def find(hints: dict[str, Any]) -> dict[str, Any]:
        return next(t for t in hints["inputs"] if t["name"].endswith(name_end))

    return find


WORD = _input("word_embeddings/Gather_output_0")


def _fused(**fields: Any) -> dict[str, Any]:
    """A FusedAttention replacement of a hints file: no shuffles, not causal, but ``fields``."""
    fused = {
        "is_causal": False,
        "q_shuffle": None,
        "k_shuffle": None,
        "v_shuffle": None,
        "nb_rank": 1,
        "polygraphy_class": "FusedAttention",
    }
    return {**fused, **fields}


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    "input seq_len_idx": (
        lambda h: WORD(h).update(seq_len_idx=2),
        "SC101",
        "inputs[name=/model/embeddings/word_embeddings/Gather_output_0].seq_len_idx",
    ),
    "output seq_len_idx": (
        lambda h: h["outputs"][0].update(seq_len_idx=2),
        "SC101",
        "outputs[name=last_hidden_state].seq_len_idx",
    ),
    "k_seq_len_idx": (lambda h: h.update(k_seq_len_idx=2), "SC105", "k_seq_len_idx"),
    "v_seq_len_idx": (lambda h: h.update(v_seq_len_idx=3), "SC106", "v_seq_len_idx"),
    "renamed tensor": (
        lambda h: WORD(h).update(name="/model/embeddings/word_embeddings/Gather_output_1"),
        "SC102",
        "inputs[name=/model/embeddings/word_embeddings/Gather_output_1].name",
    ),
    "dropped input": (
        lambda h: h["inputs"].remove(WORD(h)),
        "SC115",
        "inputs",
    ),
    "key-only input added": (
        lambda h: h["inputs"].append(
            {
                "name": "attention_mask",
                "seq_len_idx": 1,
                "rank": 2,
                "polygraphy_class": "ShardTensor",
            }
        ),
        "SC116",
        "inputs[name=attention_mask]",
    ),
    "reduce_op sum": (
        lambda h: h["dist_collectives"].update(reduce_op="sum"),
        "SC114",
        "dist_collectives.reduce_op",
    ),
    "wrong rank": (
        lambda h: WORD(h).update(rank=4),
        "SC104",
        "inputs[name=/model/embeddings/word_embeddings/Gather_output_0].rank",
    ),
    # The word embeddings' output is [batch, seq, hidden]: rank 3.
    "seq_len_idx past the rank": (
        lambda h: WORD(h).update(seq_len_idx=3),
        "SC103",
        "inputs[name=/model/embeddings/word_embeddings/Gather_output_0].seq_len_idx",
    ),
    # BERT's gathered K and V are [batch, heads, ., .]: rank 4.
    "kv_rank": (lambda h: h.update(kv_rank=3), "SC107", "kv_rank"),
    "k_seq_len_idx past the rank": (lambda h: h.update(k_seq_len_idx=4), "SC103", "k_seq_len_idx"),
    "v_seq_len_idx past the rank": (lambda h: h.update(v_seq_len_idx=5), "SC103", "v_seq_len_idx"),
    "gather_q on one layer only": (
        lambda h: h["attention_layers"][0].update(gather_q=True),
        "SC111",
        "attention_layers[*].gather_q",
    ),
    "fused shuffle not a permutation": (
        lambda h: h["attention_layers"][0].update(replace=_fused(q_shuffle=[0, 2, 2, 3])),
        "SC112",
        "attention_layers[q=/model/encoder/layer.0/attention/self/Mul_output_0].replace.q_shuffle",
    ),
    # BERT attends both ways: a fused causal attention would mask half of each row.
    "fused attention told causal": (
        lambda h: h["attention_layers"][0].update(replace=_fused(is_causal=True)),
        "SC124",
        "attention_layers[q=/model/encoder/layer.0/attention/self/Mul_output_0].replace.is_causal",
    ),
    # The fused replacement transposes the score MatMul's K, [batch, heads, head, keys].
    "fused K shuffle of three axes": (
        lambda h: h["attention_layers"][0].update(replace=_fused(k_shuffle=[0, 2, 1])),
        "SC112",
        "attention_layers[q=/model/encoder/layer.0/attention/self/Mul_output_0].replace.k_shuffle",
    ),
    "K and V not gathered": (
        lambda h: h["attention_layers"][1].update(gather_kv=False),
        "SC121",
        "attention_layers[q=/model/encoder/layer.1/attention/self/Mul_output_0].gather_kv",
    ),
    # The shape of input_ids, [2] at every length: nothing to split.
    "hinted tensor without a sequence axis": (
        lambda h: h["inputs"].append(
            {
                "name": "/model/embeddings/Shape_output_0",
                "seq_len_idx": 0,
                "rank": 1,
                "polygraphy_class": "ShardTensor",
            }
        ),
        "SC117",
        "inputs[name=/model/embeddings/Shape_output_0].seq_len_idx",
    ),
    "a tensor both scattered and gathered": (
        lambda h: h["outputs"].append(dict(WORD(h))),
        "SC122",
        "inputs[name=/model/embeddings/word_embeddings/Gather_output_0]",
    ),
    "root outside the group": (
        lambda h: h["dist_collectives"].update(group_size=2, root=2),
        "SC113",
        "dist_collectives.root",
    ),
}


def test_a_fused_shuffle_of_the_attention_s_own_k_axes_is_the_layers(
    bert_hints: dict[str, Any], tmp_path: Path
) -> None:
    # K enters BERT's score MatMul as [batch, heads, head, keys], V the context MatMul as
    # [batch, heads, keys, head]: four axes each (the projections before them have three).
    # k_shuffle [0, 1, 3, 2] brings K to [batch, heads, keys, head]; V is there already.
    hints = json.loads(json.dumps(bert_hints))
    for layer in hints["attention_layers"]:
        layer["replace"] = _fused(k_shuffle=[0, 1, 3, 2])
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hints))
    # About the shuffles only: unsimulated, as the hints' nb_rank 1 would fail on 2 ranks.
    report = verify(BERT, path, simulate=False)
    assert not [f for f in report.findings if f.code == "SC112"], report.render_text()
    # BERT's padding mask is what the fused op cannot take (SC128), and only that.
    assert {f.code for f in report.errors} == {"SC128"}, report.render_text()


def test_fused_hints_of_one_is_causal_for_every_layer_are_checked_layer_by_layer(
    tmp_path: Path,
) -> None:
    # BART's decoder self-attention is causal; its encoder and cross-attention are not.
    model, hints = REAL / "ts_bart_seq2seq_tiny.onnx", tmp_path / "fused.json"
    made = run_cli("gen", model, "-o", hints, "--cp-type", "fused", "--is-causal")
    assert made.exit_code == 0
    assert "the mask of 4 layers (first: /model/encoder/layers.0/self_attn/MatMul) is not " in (
        made.stderr
    )
    report = verify(model, hints)
    told = [f.field for f in report.errors if f.code == "SC124"]
    assert len(told) == 4 and all("/encoder" in f or "/encoder_attn/" in f for f in told), told


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_single_mutation_is_caught(
    mutation: str, bert_hints: dict[str, Any], tmp_path: Path
) -> None:
    mutate, code, field = MUTATIONS[mutation]
    hints = json.loads(json.dumps(bert_hints))
    mutate(hints)
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hints))
    result = run_cli("verify", BERT, path)
    assert result.exit_code == 1, result.stdout
    report = json.loads(run_cli("verify", BERT, path, "--format", "json").stdout)
    found = [(f["code"], f["field"]) for f in report["findings"] if f["level"] == "error"]
    assert (code, field) in found, found


PAIR_MASK = REAL / "ts_pair_mask_encoder.onnx"


@pytest.mark.parametrize(
    ("scattered", "axis", "rank", "cut_over_keys"),
    [
        # attention_mask feeds both factors of DeBERTa's mask over queries and keys: scattered,
        # it cuts the mask over the keys too (gen wrote this before it followed the factor
        # over the keys; the simulation of it fails).
        ("attention_mask", 1, 2, True),
        ("/Unsqueeze_1_output_0", 3, 4, True),  # the factor over the keys, [B, 1, 1, S]
        # The factor over the queries, [B, 1, S] turned into [B, 1, S, 1]: by broadcasting,
        # its axis 2 lines up with the mask's last, but it becomes the query axis.
        ("/Squeeze_output_0", 2, 3, False),
    ],
)
def test_a_tensor_is_key_only_where_its_axis_becomes_a_masks_key_axis(
    scattered: str, axis: int, rank: int, cut_over_keys: bool
) -> None:
    golden = read_hints(GOLDEN / "real" / "ts_pair_mask_encoder.json")
    assert [t.name for t in golden.inputs] == ["input_ids", "/Squeeze_output_0"]
    hints = golden.with_changes(inputs=(golden.inputs[0], ShardTensor(scattered, axis, rank)))
    report = verify(PAIR_MASK, hints)
    found = [f for f in report.errors if f.code == "SC116"]
    if not cut_over_keys:
        assert report.ok, report.render_text()
        return
    [finding] = found
    assert finding.field == f"inputs[name={scattered}]"
    assert f"its axis {axis} becomes the key axis of the mask " in finding.message


def test_a_sequence_input_that_becomes_a_masks_query_axis_unscattered_is_an_error() -> None:
    # Without the factor over the queries scattered, each rank builds DeBERTa's mask from the
    # whole attention_mask: all of its rows against the rank's own scores (the simulation
    # fails). It is not a key-only input, as it was called (SC119, "which is right").
    golden = read_hints(GOLDEN / "real" / "ts_pair_mask_encoder.json")
    report = verify(PAIR_MASK, golden.with_changes(inputs=golden.inputs[:1]))
    [finding] = [f for f in report.errors if f.code == "SC115"]
    assert finding.tensor == "attention_mask"
    assert "becomes the query axis of the mask " in finding.message
    assert "SC119" not in [f.code for f in report.findings]
    # With it scattered, attention_mask reaches the masks' key axes only.
    report = verify(PAIR_MASK, golden)
    assert report.ok, report.render_text()
    assert "SC119" in [f.code for f in report.findings]


@pytest.mark.parametrize(
    ("q", "observed", "says"),
    [
        # A tensor the model has, but an input of the layer, not its Q.
        (
            "/model/embeddings/word_embeddings/Gather_output_0",
            "no layer",
            "is a tensor of the model, but not the Q of any attention layer",
        ),
        ("/model/encoder/layer.0/attention/self/Mul_output_9", "absent", "is not a tensor"),
    ],
)
def test_a_hinted_q_that_is_no_layer_s_q_says_whether_the_tensor_exists(
    q: str, observed: str, says: str, bert_hints: dict[str, Any], tmp_path: Path
) -> None:
    hints = json.loads(json.dumps(bert_hints))
    hints["attention_layers"][0]["q"] = q
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hints))
    report = verify(BERT, path)
    [finding] = [f for f in report.errors if f.code == "SC108"]
    assert (finding.field, finding.observed) == (f"attention_layers[q={q}]", observed)
    assert finding.message.startswith(f"attention_layers[0].q {q!r} {says}")
    # The layer whose Q the hint lost is reported as not hinted.
    assert "SC109" in [f.code for f in report.errors]


def test_hints_made_in_python_are_refused_as_the_reader_refuses_a_file() -> None:
    # The reader refuses an unknown reduce_op in a file; verify refuses it from Python too.
    made = read_hints(GOLDEN / "real" / "ts_bert_tiny.json").with_changes(
        dist_collectives=DistCollective(reduce_op="mean")
    )
    with pytest.raises(HintsFormatError) as error:
        verify(BERT, made, hints_source="made.json")
    assert error.value.message == (
        "made.json: dist_collectives.reduce_op: expected one of 'sum', 'prod', 'min', 'max', "
        "'avg', got \"mean\""
    )


def test_hints_the_simulation_cannot_shard_with_are_a_finding_naming_the_file(
    bert_hints: dict[str, Any], tmp_path: Path
) -> None:
    hints = json.loads(json.dumps(bert_hints))
    hints["attention_layers"][0]["q"] = "nope"
    path = tmp_path / "wrong_q.json"
    path.write_text(json.dumps(hints))
    result = run_cli("verify", BERT, path, "--ranks", "2")
    # Findings (exit 1), the static ones kept: not an input error (exit 2).
    assert result.exit_code == 1, result.stdout
    lines = result.stdout.splitlines()
    assert any(line.startswith("SC108 error:") for line in lines), result.stdout
    [refused] = [line for line in lines if line.startswith("SC203 error:")]
    assert refused.endswith(
        f"cannot shard the model with these hints: {path}: attention_layers[0]: q 'nope' is "
        "not the Q of any attention layer of the model"
    )


def test_tp_hints_are_checked_as_cp_hints_with_a_warning_and_cannot_be_simulated(
    bert_hints: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "tp.json"
    path.write_text(json.dumps({**bert_hints, "parallelism": "TP"}))
    unsimulated = run_cli("verify", BERT, path, "--no-simulate")
    # gen's hints, labelled TP: the checks still pass, beside a warning.
    assert unsimulated.exit_code == 0, unsimulated.stdout
    assert (
        "SC123 warning: parallelism 'TP': shardcheck checks and shards context parallelism "
        "only; the other checks read these hints as CP hints"
    ) in unsimulated.stdout.splitlines()
    # Plain verify simulates, on 2 ranks, as --ranks 2 does: shard refuses TP hints.
    for simulated in (run_cli("verify", BERT, path), run_cli("verify", BERT, path, "--ranks", "2")):
        assert simulated.exit_code == 1, simulated.stdout
        assert (
            "SC203 error: the CP simulation on 2 ranks cannot shard the model with these hints: "
            f"{path}: parallelism 'TP': shard writes context parallelism (CP) models only"
        ) in simulated.stdout.splitlines()


def test_messages_of_the_static_checks_name_the_values(
    bert_hints: dict[str, Any], tmp_path: Path
) -> None:
    hints = json.loads(json.dumps(bert_hints))
    hints["kv_rank"] = 3
    hints["v_seq_len_idx"] = 3  # V is [batch, heads, seq, head_dim]
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hints))
    messages = {f.code: f.message for f in verify(BERT, path).errors}
    assert messages["SC107"] == "kv_rank is 3, but the gathered K and V have rank 4"
    assert messages["SC106"] == (
        "v_seq_len_idx is 3, but the gathered tensor of layer "
        "/model/encoder/layer.0/attention/self/MatMul has the sequence on axis 2; 2 layers "
        "affected"
    )


def test_a_length_past_the_position_table_is_refused_as_too_long_not_called_baked() -> None:
    # GPT-2's position table has 64 rows: it runs at 8 and at 4, not at 128.
    model, hints = REAL / "ts_gpt2_tiny.onnx", GOLDEN / "real" / "ts_gpt2_tiny.json"
    with pytest.raises(InputError) as error:
        verify(model, hints, seq_lens=(8, 128))
    assert str(error.value).startswith(
        f"{model}: the model runs at sequence lengths 4 and 8 but not at 128 (at node "
        "/model/wpe/Gather): 128 is past the longest it supports (the size of a position "
        "table, say); choose shorter --seq-lens. onnxruntime: "
    )


def test_a_length_fixed_by_the_inputs_skips_the_axis_checks_and_says_so(tmp_path: Path) -> None:
    # ViT's length is its 17 patches, fixed by the image size: no input has a dim to vary.
    model = REAL / "ts_vit_tiny.onnx"
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    report = verify(model, hints)
    assert report.ok, report.render_text()
    assert [f.code for f in report.findings] == ["SC204", "SC120"]
    # The 17 patches do not split on the 2 ranks simulated by default: what was not proved is
    # said (a warning, so --strict fails), not passed in silence.
    assert report.findings[0].message == (
        "the CP simulation on 2 ranks did not run ('model.embeddings.position_embeddings' is "
        "scattered along its axis 1, which the model fixes at 17 positions, not a multiple of "
        "the 2 ranks), so nothing shows that these hints give the single-device result when the "
        "model runs split: give --ranks a divisor of that size"
    )


def test_a_hinted_batch_axis_is_named_and_the_batch_never_varied(tmp_path: Path) -> None:
    # No axis of ViT's pixel_values carries the sequence: gen --io graph writes --i-idx 0, its
    # batch, and says so. verify named the batch the sequence: it varied it as the length
    # (from the hints) and reported the real axes as wrong (SC101, SC105, SC106).
    model = REAL / "ts_vit_tiny.onnx"
    hints = tmp_path / "graph.json"
    made = run_cli("gen", model, "-o", hints, "--io", "graph")
    assert made.exit_code == 0
    assert "no axis of pixel_values carries the sequence" in made.stderr
    report = verify(model, hints, simulate=False)  # about the axis checks only
    assert [(f.code, f.level) for f in report.findings] == [("SC117", ERROR), ("SC120", INFO)]
    assert report.errors[0].message == (
        "axis 0 of 'pixel_values' is its batch dim 'batch', not a sequence axis"
    )
    assert all(run["dims"] == {"batch": 1} for run in report.runs)


def test_polygraphy_default_k_index_is_flagged_with_the_right_one(tmp_path: Path) -> None:
    model = FIXTURES / "attention_head.onnx"
    hints = tmp_path / "polygraphy.json"
    assert run_cli("gen", model, "-o", hints, "--compat", "polygraphy").exit_code == 0
    report = verify(model, hints)
    k = [f for f in report.errors if f.code == "SC105"]
    assert len(k) == 1
    assert (k[0].field, k[0].expected, k[0].observed) == ("k_seq_len_idx", "2", "0")
    # Polygraphy's name guess also misses the input's axis ("sequence_len" is not a name it
    # knows): the run shows the sequence on axis 1.
    assert ("SC101", "inputs[name=input].seq_len_idx") in errors(report)


def test_baked_sequence_length_is_reported_with_the_node(tmp_path: Path) -> None:
    model = REAL / "ts_mha_seq_first.onnx"
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    # Unsimulated, SC002 is an error (simulated, it matches at 8: the test after the next).
    report = verify(model, hints, seq_lens=(8, 16), simulate=False)
    baked = [f for f in report.errors if f.code == "SC002"]
    # TRUTH.json names the Reshapes whose shape holds the traced length (from the model).
    assert len(baked) == 1 and baked[0].tensor == BAKED_MHA
    assert "the sequence axes cannot be checked at other lengths" in baked[0].message
    assert "simulate CP there (verify without --no-simulate)" in baked[0].message


def test_baked_length_is_reported_whichever_length_comes_first(tmp_path: Path) -> None:
    model = REAL / "ts_mha_seq_first.onnx"
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    report = verify(model, hints, seq_lens=(16, 8), simulate=False)
    assert [(f.code, f.tensor) for f in report.errors] == [("SC002", BAKED_MHA)]
    assert "runs at sequence length 8 but not at 16" in report.errors[0].message


def test_a_baked_length_is_simulated_there_and_a_match_makes_it_a_warning(tmp_path: Path) -> None:
    # gen cuts Q, K and V after the Reshapes that hold the length: every rank computes them
    # whole, so CP is exact at the traced length.
    model = REAL / "ts_mha_seq_first.onnx"
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    report = verify(model, hints, seq_lens=(8, 16), ranks=2)
    assert report.ok, report.render_text()
    assert [(f.code, f.level, f.tensor) for f in report.sorted_findings() if f.code == "SC002"] == [
        ("SC002", "warning", BAKED_MHA)
    ]
    assert (
        "the CP simulation on 2 ranks matched at 8: these hints shard it at that length "
        "only" in report.sorted_findings()[0].message
    )
    assert simulated_lengths(report) == [(8, True)]


def test_a_baked_length_that_the_slices_reach_fails_the_simulation_there(tmp_path: Path) -> None:
    # Polygraphy's choice, the graph input cut: each rank's 4 rows reach the Reshape to 8.
    model = REAL / "ts_mha_seq_first.onnx"
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints, "--io", "graph").exit_code == 0
    report = verify(model, hints, seq_lens=(8, 16), ranks=2)
    assert sorted((f.code, f.tensor) for f in report.errors) == [
        ("SC002", BAKED_MHA),
        ("SC201", f"{BAKED_MHA}_output_0"),
    ]
    assert "the CP simulation on 2 ranks at 8 did not pass" in report.sorted_findings()[0].message
    assert simulated_lengths(report) == [(8, False)]


def test_a_position_table_cut_by_gen_shards_a_fixed_length_model(tmp_path: Path) -> None:
    model = attention_model(tmp_path, positions=True)
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    assert {t["name"]: t["seq_len_idx"] for t in read_json(hints)["inputs"]} == {
        "tokens": 0,
        "pos": 0,
    }
    report = verify(model, hints, ranks=2)
    assert report.ok, report.render_text()
    assert [(f.code, f.level, f.tensor) for f in report.sorted_findings()] == [
        ("SC002", "warning", "add_positions"),
        ("SC202", "info", ""),
    ]


def test_a_baked_length_with_hints_that_scatter_nothing_stays_an_error(tmp_path: Path) -> None:
    # Every rank then computes the whole model: the simulation matches and proves nothing.
    model = attention_model(tmp_path, positions=True)
    report = verify(model, ShardHints(), ranks=2)
    assert [(f.code, f.tensor) for f in report.errors] == [("SC002", "add_positions")]
    assert "but these hints scatter nothing" in report.errors[0].message


def test_text_and_json_reports_have_the_same_findings(bert_hints: dict, tmp_path: Path) -> None:
    hints = json.loads(json.dumps(bert_hints))
    hints["k_seq_len_idx"] = 2
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hints))
    text = run_cli("verify", BERT, path).stdout
    document = json.loads(run_cli("verify", BERT, path, "--format", "json").stdout)
    assert document["ok"] is False
    for finding in document["findings"]:
        assert f"{finding['code']} {finding['level']}: {finding['message']}" in text


@pytest.mark.skipif(not ANCHORS.is_dir(), reason="../shared/anchor-models is not present")
def test_polygraphy_example_that_fails_at_a_dim_of_2_is_reported_not_crashed(
    tmp_path: Path,
) -> None:
    # Its input is [sequence_len, batch, 100], but it attends over the axis named batch: that
    # is the dim verify varies, and sequence_len gets the default 2, where the model fails.
    model = ANCHORS / "attention_head.onnx"
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints, "--compat", "polygraphy").exit_code == 0
    result = run_cli("verify", model, hints)
    assert result.exit_code == 1
    assert (
        "SC001 error: the model does not run in onnxruntime with sequence_len=2, batch=8"
        in result.stdout
    )
    assert "give them with --seq-lens and --dim" in result.stdout
    assert "MatMul" in result.stdout and "Traceback" not in result.output


def test_the_watched_outputs_appended_to_the_files_bytes_make_the_same_model() -> None:
    """verify gives onnxruntime the file's bytes followed by the new graph outputs (protobuf
    merges them) instead of serializing the model again: the same model must come out."""
    import onnx

    from shardcheck.graph.loader import parse_model
    from shardcheck.verification.session import serialized_with_outputs

    parsed = parse_model(BERT)
    assert parsed.serialized is not None
    index = GraphIndex(parsed.model, source=str(BERT))
    extra = [index.nodes[i].outputs[0] for i in (3, 10, 3)]  # a repeat is added once
    extra.append(index.graph_outputs[0])  # already an output: not added again
    appended = onnx.ModelProto.FromString(serialized_with_outputs(index, extra, parsed.serialized))
    serialized = onnx.ModelProto.FromString(serialized_with_outputs(index, extra))
    assert appended == serialized
    names = [o.name for o in appended.graph.output]
    assert names == [*index.graph_outputs, extra[0], extra[1]]
    assert [o.name for o in index.model.graph.output] == index.graph_outputs  # lent, given back


def test_a_slow_model_load_is_announced_on_the_progress_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """onnxruntime loads the model in the background; waiting for it more than a second says
    so (a real session, made a little late)."""
    import time

    from shardcheck.verification import session as session_module

    make = session_module.load_session

    def slow_session(*args: Any) -> Any:
        time.sleep(1.3)
        return make(*args)

    monkeypatch.setattr(session_module, "load_session", slow_session)
    heard: list[str] = []
    report = verify(FIXTURES / "attention.onnx", GOLDEN / "attention.json", progress=heard.append)
    assert report.ok
    assert heard[0] == "onnxruntime is still loading the model..."


def _reshaping_model(directory: Path, length: int | None) -> Path:
    """x [s, 3] -> Reshape -> y; with ``length``, the Reshape's target holds it (the model
    runs at that length only), else it follows x's own shape."""
    target = [length, 3] if length is not None else [-1, 3]
    nodes = [
        helper.make_node(
            "Constant",
            [],
            ["target"],
            value=helper.make_tensor("target", TensorProto.INT64, [2], target),
        ),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    graph = helper.make_graph(
        nodes,
        "reshaping",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["s", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["s", 3])],
    )
    path = directory / f"reshaping_{length}.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path
    )
    return path


def test_a_simulation_that_cannot_be_prepared_is_reported_only_if_the_model_runs(
    tmp_path: Path,
) -> None:
    """verify prepares the simulation before its runs (its sessions are made meanwhile); an
    error in preparing it is the outcome only when the runs leave something to simulate."""
    hints = ShardHints(
        inputs=(ShardTensor("x", 0),),
        outputs=(ShardTensor("y", 0),),
        dist_collectives=DistCollective(groups=(0, 2)),  # rank 2 is not simulated
    )
    with pytest.raises(InputError, match="the group names rank 2, but 2 ranks"):
        verify(_reshaping_model(tmp_path, None), hints, ranks=2)

    report = verify(_reshaping_model(tmp_path, 4), hints, ranks=2)
    assert not report.ok
    assert {"SC001", "SC002"} & {finding.code for finding in report.errors}
    assert not any(run.get("simulation") for run in report.runs)


LEFT_RUNNING = """
import sys
import time
from onnx import TensorProto, helper
from shardcheck.runtime.background import InBackground
from shardcheck.cli import main
from shardcheck.runtime.sessions import make_session

def chain(length):
    nodes = [
        helper.make_node("Relu", [f"t{i}" if i else "x"], [f"t{i + 1}" if i < length - 1 else "y"])
        for i in range(length)
    ]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "chain", info[:1], info[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()

# Chains whose sessions take a fraction of a second to make: 20k nodes on onnxruntime 1.32;
# before it, making a session grew with the square of a chain's length (2k nodes: ~1 s).
started = time.perf_counter()
make_session(chain(2000))
seconds = time.perf_counter() - started
long_chain = chain(max(2000, min(20000, int(2000 / max(seconds, 1e-3)))))
kept = make_session(long_chain)  # a live session at the end too
for name in ("a", "b"):  # still being made when the command ends
    InBackground(name, make_session, long_chain)
sys.argv = ["shardcheck", "verify", sys.argv[1], sys.argv[2]]
main()
"""


def test_the_exit_code_is_the_verdicts_while_onnxruntime_still_works_in_the_background() -> None:
    """Sessions being made in background threads when the command ends (a simulation that
    will not run, verify's own on an early error) must not crash the process on its way out:
    the interpreter's teardown under them segfaulted or aborted (exit 139 or 134)."""
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-c",
            LEFT_RUNNING,
            str(FIXTURES / "attention.onnx"),
            str(GOLDEN / "attention.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    assert "PASS" in done.stdout


def _slowed(monkeypatch: pytest.MonkeyPatch, module_name: str, function: str) -> None:
    """Make ``module.function`` (a session maker) take a second more."""
    import importlib
    import time

    module = importlib.import_module(module_name)
    make = getattr(module, function)

    def slow(*args: Any) -> Any:
        time.sleep(1.0)
        return make(*args)

    monkeypatch.setattr(module, function, slow)


def _alive(name: str) -> bool:
    import threading

    return any(thread.name == name and thread.is_alive() for thread in threading.enumerate())


def test_an_error_leaves_no_session_being_made_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify starts onnxruntime before the checker has spoken; when the checker refuses the
    model, verify waits for that session before raising (a process that ends while one is
    being made crashes). Same for the simulation's single-device session."""
    model = onnx.load(str(FIXTURES / "attention.onnx"))
    model.graph.node[1].name = model.graph.node[0].name = "twice"  # refused by the checks
    path = tmp_path / "duplicate_names.onnx"
    onnx.save(model, path)
    _slowed(monkeypatch, "shardcheck.verification.session", "load_session")
    with pytest.raises(InputError, match="twice"):
        verify(path, GOLDEN / "attention.json")
    assert not _alive("shardcheck-session")

    from shardcheck.simulation.simulate import simulate

    _slowed(monkeypatch, "shardcheck.simulation.simulate", "make_session")
    wrong = ShardHints(inputs=(ShardTensor("no_such_tensor", 0),))
    with pytest.raises(InputError, match="no_such_tensor"):
        simulate(FIXTURES / "attention.onnx", wrong, ranks=2, seq_len=8)
    assert not _alive("shardcheck-single-device")


def test_the_findings_doc_lists_every_finding_code_once() -> None:
    from shardcheck.verification.findings import CODES

    findings_doc = (REAL.parents[1] / "docs" / "findings.md").read_text()
    listed = re.findall(r"\| (SC\d{3}) \|", findings_doc)
    assert sorted(listed) == sorted(CODES)


def test_hints_that_scatter_the_batch_axis_are_findings_under_ranks_not_a_dim_error(
    tmp_path: Path,
) -> None:
    # The hints say the sequence is the input's axis 0, named batch. verify's runs set batch
    # to 1 (the model's sequence is sequence_len): the simulation of those runs must report,
    # not take verify's own dims for a --dim that pins the hints' sequence dim.
    hints = read_hints(FIXTURES.parent / "golden" / "attention_head.json")
    hints = hints.with_changes(inputs=(ShardTensor("input", 0, 3),))
    report = verify(FIXTURES / "attention_head.onnx", hints, ranks=2)
    codes = {f.code for f in report.errors}
    assert "SC101" in codes and "SC201" in codes, report.render_text()


def test_the_json_report_is_the_same_from_run_to_run(tmp_path: Path) -> None:
    # People diff it (CI uploads it): no timings in it.
    model, hints = REAL / "ts_sdpa.onnx", GOLDEN / "real" / "ts_sdpa.json"
    first = run_cli("verify", model, hints, "--ranks", "2", "--format", "json")
    second = run_cli("verify", model, hints, "--ranks", "2", "--format", "json")
    assert first.exit_code == 0, first.stdout
    assert first.stdout == second.stdout
    assert [sorted(run) for run in json.loads(first.stdout)["runs"]] == [
        ["dims", "ok", "seq_len"],
        ["dims", "ok", "seq_len"],
        ["dims", "ok", "ranks", "seq_len", "simulation"],
        ["dims", "ok", "ranks", "seq_len", "simulation"],
    ]


@pytest.mark.parametrize("value", [0, -1])
def test_a_dim_below_1_is_refused_without_ranks_too(value: int) -> None:
    # It was checked only where the simulation resolves dims: without --ranks, 0 ran empty
    # tensors and passed, -1 failed inside numpy.
    model, hints = REAL / "ts_sdpa.onnx", GOLDEN / "real" / "ts_sdpa.json"
    with pytest.raises(InputError) as error:
        verify(model, hints, dims={"batch": value})
    assert error.value.message == f"--dim batch={value}: a dim must be a positive integer"


def _attention_of_qkv() -> list[onnx.NodeProto]:
    """softmax(q @ k^T) @ v of 3-D q, k and v, into y."""
    return [
        helper.make_node("Transpose", ["k"], ["kT"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kT"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]


def _cross_attention_model(path: Path) -> Path:
    """Q from x, K and V from a memory input of its own length (cross-attention)."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), name)
        for name in ("Wq", "Wk", "Wv")
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", ["mem", "Wk"], ["k"]),
        helper.make_node("MatMul", ["mem", "Wv"], ["v"]),
        *_attention_of_qkv(),
    ]
    graph = helper.make_graph(
        nodes,
        "cross",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8]),
            helper.make_tensor_value_info("mem", TensorProto.FLOAT, ["batch", "mlen", 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def _strided_frames_model(path: Path, kernel: int = 2) -> Path:
    """Attention over frames a strided convolution makes of ``audio`` [batch, samples, 4]:
    (samples - kernel) // 2 + 1 of them, as a speech model makes frames of its samples."""
    rng = np.random.default_rng(0)
    shapes = {"conv_w": (8, 4, kernel), "wq": (8, 8), "wk": (8, 8), "wv": (8, 8)}
    weights = [
        numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32), name)
        for name, shape in shapes.items()
    ]
    nodes = [
        helper.make_node("Transpose", ["audio"], ["channels_first"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["channels_first", "conv_w"], ["conv"], strides=[2]),
        helper.make_node("Transpose", ["conv"], ["frames"], perm=[0, 2, 1]),
        *(helper.make_node("MatMul", ["frames", f"w{t}"], [t]) for t in "qkv"),
        *_attention_of_qkv(),
    ]
    graph = helper.make_graph(
        nodes,
        "strided_frames",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", "samples", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None, 8])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def test_the_ranks_must_divide_the_scattered_axis_not_the_length_it_is_made_of(
    tmp_path: Path,
) -> None:
    # gen scatters the convolution's output along its frames. 9 and 17 samples make 4 and 8
    # frames, which 2 ranks divide (they were refused: 9 and 17 are odd); 10 samples make 5,
    # which they do not (it was let through, and failed in the simulation).
    model = _strided_frames_model(tmp_path / "frames.onnx")
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    assert [(t.name, t.seq_len_idx) for t in read_hints(hints).inputs] == [("conv", 2)]
    report = verify(model, hints, seq_lens=(9, 17), ranks=2)
    assert report.ok and "SC202" in [f.code for f in report.findings], report.render_text()
    with pytest.raises(InputError) as refused:
        verify(model, hints, seq_lens=(10, 18), ranks=2)
    assert str(refused.value) == (
        "--ranks 2: at sequence length 10, 'conv' is scattered along its axis 2, which then has "
        "5 positions, not a multiple of the 2 ranks; choose --seq-lens accordingly"
    )
    # With a kernel of 4, one sample makes (1 - 4) // 2 + 1 = -1 frames: the model does not run
    # there, which its run reports; no count of positions is refused for it.
    wide = _strided_frames_model(tmp_path / "wide.onnx", kernel=4)
    shapes = ShapeInference(load_index(wide))
    made = read_hints(hints)
    assert first_unsplittable(shapes, made, 2, {"batch": 1, "samples": 1}, ["samples"]) is None
    unsplit = first_unsplittable(shapes, made, 2, {"batch": 1, "samples": 12}, ["samples"])
    assert unsplit is not None and (unsplit[0].name, unsplit[1]) == ("conv", 5)
    assert run_cli("simulate", model, hints, "--ranks", "2", "--seq-len", "9").exit_code == 0
    refused_cli = run_cli("simulate", model, hints, "--ranks", "2", "--seq-len", "10")
    assert refused_cli.exit_code == 2
    assert "'conv' is scattered along its axis 2, which then has 5 positions" in (
        refused_cli.stderr
    )


def test_k_and_v_computed_whole_need_no_gather(tmp_path: Path) -> None:
    # Only x is scattered; K and V come from the whole memory on every rank: nothing to gather.
    model = _cross_attention_model(tmp_path / "cross.onnx")
    hints = ShardHints(
        attention_layers=(AttentionLayerHint("q", gather_kv=False, gather_q=False),),
        inputs=(ShardTensor("x", 1, 3),),
        outputs=(ShardTensor("y", 1, 3),),
        k_seq_len_idx=2,
        v_seq_len_idx=1,
        kv_rank=3,
    )
    report = verify(model, hints, ranks=2)
    assert report.ok, report.render_text()
    assert [f.code for f in report.findings] == ["SC202", "SC202"]
    # Scattering the memory too splits K and V: then they must be gathered.
    split = verify(model, hints.with_changes(inputs=(*hints.inputs, ShardTensor("mem", 1, 3))))
    assert "SC121" in [f.code for f in split.errors]
    # Nor need the layer be hinted at all while its K and V are whole (SC109 is for split ones).
    unhinted = verify(model, hints.with_changes(attention_layers=()), ranks=2)
    assert unhinted.ok, unhinted.render_text()
    assert [f.code for f in unhinted.findings] == ["SC202", "SC202"]


def test_a_kv_index_inside_one_layer_s_rank_is_no_sc103(tmp_path: Path) -> None:
    # mixed_rank_attention's gathered K are of rank 3 (flat_mm1) and 4 (heads_mm1).
    model = FIXTURES / "mixed_rank_attention.onnx"
    hints = tmp_path / "h.json"
    forced = ("--k-idx", "3", "--v-idx", "2", "--kv-rank", "4")
    assert run_cli("gen", model, "-o", hints, *forced).exit_code == 0
    codes = [f.code for f in verify(model, hints).errors]
    assert "SC103" not in codes and "SC105" in codes  # flat_mm1's K has no axis 3
    past = read_hints(hints).with_changes(k_seq_len_idx=4)
    [outside] = [f for f in verify(model, past).errors if f.code == "SC103"]
    assert outside.message == (
        "k_seq_len_idx 4 is outside the rank 4 of the gathered K (its largest)"
    )


def test_the_checkers_verdict_comes_before_what_the_analysis_refuses(tmp_path: Path) -> None:
    """The checker runs after the analysis (it holds the GIL, and onnxruntime is making the
    session meanwhile); on an invalid model, its verdict is still the one given."""
    model = onnx.load(FIXTURES / "attention_head.onnx")
    model.graph.node[0].op_type = "NoSuchOp"
    path = tmp_path / "invalid.onnx"
    onnx.save(model, path)
    # Valid, the model would be refused for the --dim: the analysis reads the dims first.
    with pytest.raises(ModelError, match=r"fails onnx\.checker.*NoSuchOp"):
        verify(path, GOLDEN / "attention_head.json", dims={"no_such_dim": 4})
    with pytest.raises(InputError, match="no dim 'no_such_dim'"):
        verify(
            FIXTURES / "attention_head.onnx",
            GOLDEN / "attention_head.json",
            dims={"no_such_dim": 4},
        )


def test_hints_that_scatter_nothing_are_warned_of() -> None:
    # gen finds no attention in the MLP and writes hints without a tensor to scatter: they
    # pass, but every rank would compute the whole model.
    report = verify(FIXTURES / "no_attention.onnx", GOLDEN / "no_attention.json")
    assert report.ok, report.render_text()
    [warned] = [f for f in report.findings if f.code == "SC125"]
    assert warned.level == WARNING
    assert warned.message.endswith("(and no attention layer was found in the model)")
    bert = verify(BERT, GOLDEN / "real" / "ts_bert_tiny.json")
    assert "SC125" not in [f.code for f in bert.findings]


def _multi_head_attention_layers(path: Path) -> Path:
    """Two com.microsoft MultiHeadAttention layers, the second's Q, K and V projected from the
    first's output, both masked over the keys by the graph input ``mask`` [batch, sequence]
    (their key_padding_mask), as onnxruntime's transformer optimizer fuses BERT."""
    rng = np.random.default_rng(0)
    weights, nodes, source = [], [], "x"
    for layer in range(2):
        for t in "qkv":
            matrix = (0.3 * rng.standard_normal((8, 8))).astype(np.float32)
            weights.append(numpy_helper.from_array(matrix, f"w{t}{layer}"))
            nodes.append(helper.make_node("MatMul", [source, f"w{t}{layer}"], [f"{t}{layer}"]))
        nodes.append(
            helper.make_node(
                "MultiHeadAttention",
                [f"q{layer}", f"k{layer}", f"v{layer}", "", "mask"],
                [f"out{layer}"],
                domain="com.microsoft",
                num_heads=2,
            )
        )
        source = f"out{layer}"
    graph = helper.make_graph(
        nodes,
        "multi_head_attention",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 8]),
            helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("out1", TensorProto.FLOAT, ["batch", "sequence", 8])],
        weights,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=8), path)
    return path


def test_a_key_mask_of_fused_attention_leads_nowhere_past_the_node(tmp_path: Path) -> None:
    # The walk from mask went through the first layer's node to the second's Q, and called it
    # a sequence input to scatter (SC115) while the hints were right: the simulation matches.
    model = _multi_head_attention_layers(tmp_path / "mha.onnx")
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    report = verify(model, hints, ranks=2)
    assert report.ok, report.render_text()
    assert [f.code for f in report.findings].count("SC202") == 2
    [whole] = [f for f in report.findings if f.code == "SC119"]
    assert whole.tensor == "mask"
