"""Default gen on real exports: right axes, and hints that make CP exact.

The axes are checked against fixtures/real/TRUTH.json (written from the PyTorch models) and by
onnxruntime runs (verify); exactness by the N-rank CP simulation against one device.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli, simulated_lengths

from shardcheck import GenOptions, generate, load_index, simulate, verify
from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.errors import AnalysisError
from shardcheck.generation.generate import _kv_axes
from shardcheck.runtime.sizes import graph_input_dims

REAL = FIXTURES / "real"
TRUTH = json.loads((REAL / "TRUTH.json").read_text())
SHARDABLE = sorted(
    name
    for name, truth in TRUTH.items()
    if truth["runs_at_other_seq_lens"]
    and truth["inputs"]
    and any(axis is not None for axis in truth["inputs"].values())
    and "no_exact_hints" not in truth
    and "attention_in_functions" not in truth
    # It fails on one device at inputs that select other experts (SC003): not at every seed.
    and "fails_where_selections_differ" not in truth
)
# Models whose layers are in model-local functions, which no hint can name: what gen and
# verify say of them is in tests/analysis/test_hidden.py.
IN_FUNCTIONS = sorted(name for name, truth in TRUTH.items() if "attention_in_functions" in truth)
# Models on which no hints in the Polygraphy format make CP exact (TRUTH.json says why).
NO_EXACT_HINTS = sorted(name for name, truth in TRUTH.items() if "no_exact_hints" in truth)
# Models whose sequence length is baked into Reshape constants (TRUTH.json names the nodes).
BAKED = sorted(name for name, truth in TRUTH.items() if truth.get("baked_length_nodes"))
# Models that run at their traced length only: those, and Whisper's encoder (its position
# table is added whole).
TRACED_LENGTH_ONLY = sorted(name for name, truth in TRUTH.items() if "traced_seq_len" in truth)
# Positions or a causal mask computed from the sequence length inside the model.
POSITION_DEPENDENT = sorted(
    name for name in SHARDABLE if TRUTH[name]["positions"] != "none" or TRUTH[name]["causal"]
)


def hints_file(tmp_path: Path, name: str, *options: str) -> Path:
    out = tmp_path / f"{name}.json"
    result = run_cli("gen", REAL / TRUTH[name]["file"], "-o", out, *options)
    assert result.exit_code == 0, result.stderr
    return out


def test_the_shardable_set_is_what_the_fixtures_promise() -> None:
    assert "ts_mha_seq_first" not in SHARDABLE  # its length is baked into Reshape constants
    assert "ts_vit_tiny" not in SHARDABLE  # 17 patches: the length is fixed by the image
    # Their causal masks' rows follow len(Q): read from Q (GPT-Neo), or from the scores; the
    # dynamo exporter's Bloom reshapes its scores by the mask's whole length; TorchScript's
    # MPT slices its ALiBi bias by K's length before the gather; DeBERTa multiplies K by its
    # relative position table before the gather; XGLM views its scores by K's length before
    # the gather (TorchScript) or by the mask's whole length (dynamo); transformers 4.57's
    # ModernBERT builds its window over the length of a mask its first layer reads.
    assert NO_EXACT_HINTS == [
        "dynamo_bloom_tiny",
        "dynamo_deberta_tiny",
        "dynamo_deberta_v2_tiny",
        "dynamo_xglm_tiny",
        "ts_deberta_tiny",
        "ts_deberta_v2_tiny",
        "ts_einsum_causal",
        "ts_gptneo_tiny",
        "ts_modernbert_tf4",
        "ts_mpt_tiny",
        "ts_xglm_tiny",
    ]
    assert {"ts_einsum_attention", "dynamo_einsum_causal"} <= set(SHARDABLE)
    assert BAKED == ["ts_mha_seq_first", "ts_transformer_encoder", "ts_transformer_seq2seq"]
    assert TRACED_LENGTH_ONLY == [*BAKED, "ts_whisper_encoder"]
    assert {"ts_gpt2_tiny", "ts_llama_tiny_gqa", "ts_bert_tiny", "dynamo_llama_tiny_gqa"} <= set(
        POSITION_DEPENDENT
    )


@pytest.mark.parametrize("name", sorted(set(TRUTH) - set(IN_FUNCTIONS)))
def test_graph_io_axes_match_the_truth(name: str) -> None:
    truth = TRUTH[name]
    hints = generate(load_index(REAL / truth["file"]), GenOptions(io="graph")).hints
    for tensor in (*hints.inputs, *hints.outputs):
        expected = {**truth["inputs"], **truth["outputs"]}[tensor.name]
        if expected is not None:
            assert tensor.seq_len_idx == expected, tensor
    if truth["k_transposed_before_matmul"]:
        assert hints.k_seq_len_idx == truth["attention_nodes"][0]["k_seq_axis"]


@pytest.mark.parametrize("name", SHARDABLE)
def test_default_hints_pass_verify(name: str, tmp_path: Path) -> None:
    report = verify(REAL / TRUTH[name]["file"], hints_file(tmp_path, name), seq_lens=(8, 16))
    assert report.ok, report.render_text()


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", SHARDABLE)
def test_default_hints_make_cp_exact(name: str, ranks: int, tmp_path: Path) -> None:
    result = simulate(
        REAL / TRUTH[name]["file"], hints_file(tmp_path, name), ranks=ranks, seq_len=16
    )
    assert result.ok, result.summary()


# onnxruntime runs some at batch 1 only (TRUTH.json's batches: an opset 23 RotaryEmbedding's
# tables of one batch row).
AT_BATCH_2 = [name for name in SHARDABLE if 2 in TRUTH[name].get("batches", (1, 2))]


@pytest.mark.parametrize("name", AT_BATCH_2)
def test_default_hints_make_cp_exact_at_batch_2(name: str, tmp_path: Path) -> None:
    # verify and simulate run at batch 1 unless told: a cut along a merged batch*sequence axis
    # (the dynamo exporter's GPT-2 flattens its tokens) was exact there only.
    path = REAL / TRUTH[name]["file"]
    batches = {n: 2 for n in graph_input_dims(load_index(path)) if BATCH_LIKE.search(n)}
    assert batches, "every shardable fixture has a batch dim"
    result = simulate(path, hints_file(tmp_path, name), ranks=2, seq_len=16, dims=batches)
    assert result.ok, result.summary()


@pytest.mark.parametrize("name", NO_EXACT_HINTS)
def test_gen_warns_where_no_hints_make_cp_exact(name: str, tmp_path: Path) -> None:
    result = run_cli("gen", REAL / TRUTH[name]["file"], "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert "no exact cut" in result.stderr and "CP may not be exact" in result.stderr
    # The warning is true: the simulation of the hints gen wrote differs from one device.
    for ranks in (2, 4):
        outcome = simulate(REAL / TRUTH[name]["file"], tmp_path / "h.json", ranks=ranks, seq_len=16)
        assert not outcome.ok


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_gen_warns_of_a_fixed_or_baked_length_where_the_model_has_one(
    name: str, tmp_path: Path
) -> None:
    truth = TRUTH[name]
    result = run_cli("gen", REAL / truth["file"], "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    # Masks of unknown shape are warned of only where no hints make CP exact.
    if "is not fully known" in result.stderr:
        assert name in NO_EXACT_HINTS, result.stderr
    warned = [line for line in result.stderr.splitlines() if "length is baked" in line]
    fixed = [line for line in result.stderr.splitlines() if "sequence length is fixed" in line]
    # ViT's 17 patches (the image's size fixes them) and Whisper's 8 positions (its table's).
    positions = truth.get("sequence_length_fixed", truth.get("fixed_positions"))
    assert bool(fixed) == (positions is not None)
    if fixed:
        assert f"is fixed at {positions} in this model" in fixed[0]
    if name not in BAKED:
        assert not warned
        return
    # An encoder-decoder traced with a target of its own length: that one is baked too.
    own = truth.get("traced_lengths_of", {})
    nodes = [
        node["node"]
        for node in truth["baked_length_nodes"]
        if node["constant_value"][0] == truth["traced_seq_len"]
    ]
    lengths = {node["constant_value"][0] for node in truth["baked_length_nodes"]}
    assert lengths == {truth["traced_seq_len"], *own.values()}
    assert len(warned) == 1
    assert f"the sequence length is baked into the model: {nodes[0]} (and " in warned[0]
    assert f"{len(nodes) - 1} other Reshape" in warned[0]
    also = "".join(f" (and its {dim} dim one of {n})" for dim, n in own.items())
    assert f"holds a length of {truth['traced_seq_len']}{also}, so the model runs" in warned[0]
    # The command it suggests runs the model at its traced lengths.
    lengths_of = "".join(f" --seq-len {dim}={n},{2 * n}" for dim, n in own.items())
    assert (
        f"--seq-lens {truth['traced_seq_len']},{2 * truth['traced_seq_len']}{lengths_of}'"
        in (warned[0])
    )


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", TRACED_LENGTH_ONLY)
def test_default_hints_shard_a_model_at_the_one_length_it_runs_at(
    name: str, ranks: int, tmp_path: Path
) -> None:
    # The cuts fall after the Reshapes that hold the length (they compute whole on every
    # rank), or scatter the position table with the positions (Whisper).
    truth = TRUTH[name]
    traced = truth["traced_seq_len"]
    # Each sequence dim at the length it was traced at (nn.Transformer's source and target).
    own = {dim: (n, 2 * n) for dim, n in truth.get("traced_lengths_of", {}).items()}
    report = verify(
        REAL / truth["file"],
        hints_file(tmp_path, name),
        seq_lens=(traced, 2 * traced),
        seq_len_of=own,
        ranks=ranks,
    )
    assert report.ok, report.render_text()
    baked = [f for f in report.findings if f.code == "SC002"]
    assert len(baked) == 1 and baked[0].level == "warning"
    # A node that holds a traced length (which one fails first depends on the run's order).
    holding = {node["node"] for node in truth.get("baked_length_nodes", ())}
    assert baked[0].tensor in {*truth["ort_failing_nodes"], *holding}
    assert simulated_lengths(report) == [(traced, True)]


@pytest.mark.parametrize("name", POSITION_DEPENDENT)
def test_graph_input_hints_fail_the_simulation_with_a_culprit(name: str, tmp_path: Path) -> None:
    hints = hints_file(tmp_path, name, "--io", "graph")
    result = simulate(REAL / TRUTH[name]["file"], hints, ranks=2, seq_len=8)
    assert not result.ok
    assert result.mismatch is not None and result.mismatch.tensor and result.mismatch.node


def test_layers_that_need_different_k_indices_are_reported_not_written(tmp_path: Path) -> None:
    model = FIXTURES / "mixed_rank_attention.onnx"
    with pytest.raises(AnalysisError) as caught:
        generate(load_index(model), GenOptions())
    assert "k_seq_len_idx (2 for flat_mm1; 3 for heads_mm1)" in caught.value.message
    out = tmp_path / "h.json"
    result = run_cli("gen", model, "-o", out)
    assert result.exit_code == 1
    assert not out.exists()
    # Every value the layers disagree on is named in the one run, with its option.
    assert result.stderr.count("\n") == 1
    assert "v_seq_len_idx (1 for flat_mm1; 2 for heads_mm1)" in result.stderr
    assert "kv_rank (3 for flat_mm1; 4 for heads_mm1)" in result.stderr
    assert "(--k-idx, --v-idx and --kv-rank)" in result.stderr
    forced = run_cli("gen", model, "-o", out, "--k-idx", "3", "--v-idx", "2", "--kv-rank", "4")
    assert forced.exit_code == 0 and json.loads(out.read_text())["k_seq_len_idx"] == 3


def test_every_suggested_tensor_has_its_rank() -> None:
    # GPT-J repeats its rotary tables with Tile; Bloom folds heads into the batch axis
    # ([batch*heads, seq, d]). Both once lost the ranks (and so the axes) downstream.
    for name in ("ts_gptj_tiny", "ts_bloom_tiny", "dynamo_distilbert_tiny"):
        hints = generate(load_index(REAL / TRUTH[name]["file"]), GenOptions()).hints
        assert all(t.rank is not None for t in (*hints.inputs, *hints.outputs)), name


@pytest.mark.parametrize("name", ["ts_bloom_tiny", "ts_gptj_tiny"])
def test_graph_io_finds_the_sequence_axis_of_folded_heads(name: str) -> None:
    hints = generate(load_index(REAL / TRUTH[name]["file"]), GenOptions(io="graph")).hints
    assert {t.name: t.seq_len_idx for t in hints.inputs} == TRUTH[name]["inputs"]
    assert {t.name: t.seq_len_idx for t in hints.outputs} == TRUTH[name]["outputs"]


def test_fused_multihead_attention_hints_make_cp_exact(tmp_path: Path) -> None:
    model = FIXTURES / "ms_multihead_attention.onnx"
    out = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", out).exit_code == 0
    hints = json.loads(out.read_text())
    assert [(t["name"], t["seq_len_idx"]) for t in hints["inputs"]] == [("x", 1)]
    assert [(t["name"], t["seq_len_idx"]) for t in hints["outputs"]] == [("y", 1)]
    for ranks in (2, 4):
        assert simulate(model, out, ranks=ranks, seq_len=8).ok


def test_a_layer_is_named_once_when_its_k_and_v_ranks_differ() -> None:
    """A layer whose K has rank 3 and V rank 4 was named in two groups of one message
    (``kv_rank (3 for m1; 4 for m1)``): it is one group, its K and V told apart."""
    index = load_index(FIXTURES / "mixed_rank_attention.onnx")
    flat, heads = detect_attention(index)
    layers = [dataclasses.replace(flat, v_rank=4), heads]
    with pytest.raises(AnalysisError) as caught:
        _kv_axes(index, layers, GenOptions(k_idx=0, v_idx=0))
    assert "kv_rank (K 3 and V 4 for flat_mm1; 4 for heads_mm1)" in caught.value.message
    assert caught.value.message.count("flat_mm1") == 1
