"""The plan gen writes by default on real exports: the hints, plus the extension where the
Polygraphy format cannot say the better cut (issue 27, item 2).

On every listed export whose only sequence-mixing ops are its attention layers, the default
plan runs at least 95% of the projection and MLP FLOPs on slices (planning/'s count) and passes
``verify --ranks 2`` and ``--ranks 4`` at batch 1 and 2. The hints file stays the one Polygraphy
0.53.6 loads and shards; every extension gen writes is exact in the simulation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    FIXTURES,
    assert_verified_at_two_and_four_ranks,
    gen_plan,
    read_json,
    run_cli,
)
from projection_count import projection_share_on_slices

from shardcheck import load_index
from shardcheck.hints.files import read_hints
from shardcheck.planning.plan import make_plan

REAL = FIXTURES / "real"
# The exports issue 27 names (Llama-GQA and GPT-2 from both exporters, StableLM, MPT) and the
# others of fixtures/real/ whose cut the extension moves out of the layers.
SPLIT_BY_DEFAULT = [
    "ts_llama_tiny_gqa",
    "dynamo_llama_tiny_gqa",
    "ts_gpt2_tiny",
    "dynamo_gpt2_tiny",
    "dynamo_gpt2_causal_ids",
    "dynamo_stablelm_tiny",
    "ts_stablelm_tiny",
    "dynamo_mpt_tiny",
    # ALiBi sliced along the keys by K's length before the gather.
    "ts_mpt_tiny",
    # ALiBi, its scores reshaped inside each layer by the mask's whole length.
    "dynamo_bloom_tiny",
    "ts_falcon_tiny",
    # Falcon's K and V heads picked out of its fused QKV by a GatherND (analysis/axes.py).
    "dynamo_falcon_gqa_tiny",
    "ts_gptj_tiny",
    "dynamo_distilbert_tiny",
    # Relative positions, and K gathered for its product with their table (test_kv_for_readers.py).
    "ts_deberta_v2_tiny",
    "dynamo_deberta_v2_tiny",
    "ts_deberta_tiny",
    "dynamo_deberta_tiny",
    # Scores viewed by the length of K before its gather (test_key_lengths.py).
    "ts_xglm_tiny",
    "dynamo_xglm_tiny",
    # K and V through a Concat of one input (an empty cache's): XLM's trace.
    "ts_xlm_tiny",
    # One attention_mask.shape[1] for the positions and the padding mask's rows and keys
    # (test_mask_rows.py).
    "dynamo_xlm_tiny",
    # A second half of V weighed by a layer's probabilities beside it (test_value_halves.py).
    "dynamo_diffllama_tiny",
    # F.pad's pads folded through a matrix of constants (tests/analysis/test_shapes.py).
    "ts_mobilebert_tiny",
    # Projections by Convs of kernel 1.
    "ts_squeezebert_tiny",
    "dynamo_squeezebert_tiny",
    "dynamo_pair_mask_encoder",
    "ts_sdpa_causal",
    "ts_qwen3_moe_tiny",
    "dynamo_mixtral_moe_tiny",
    # Multi-head latent attention, its K halves copied into a new buffer (ScatterND), and a
    # mixture of experts with group-limited routing (GatherElements, ScatterElements).
    "dynamo_deepseek_v3_tiny",
    # The same by TorchScript: its copies address every axis by a grid of Ranges
    # (tests/analysis/test_index_grid.py).
    "ts_deepseek_v3_tiny",
    # A router that scatters a buffer sized by its own ArgMax (test_mixed_lengths.py).
    "dynamo_phimoe_tiny",
    # Graph outputs that expose slices, gathered for the output alone (test_for_output.py).
    "ts_bert_exposed",
    "dynamo_bert_exposed",
    "ts_query_given_out",
    "dynamo_query_given_out",
    # Attention inside model-local functions, inlined by the extension (test_inlined.py).
    "ts_attention_in_functions",
    "ts_rotary_gqa_in_functions",
    "ts_mlp_in_functions",
    # transformers 4's masks: a decoder's viewed by two whole lengths, BERT's expanded then
    # masked_fill-ed (test_transformers4_masks.py).
    "dynamo_llama_tf4_gqa",
    "dynamo_gpt2_tf4",
    "dynamo_bert_tf4",
    # transformers 4.46's: the padding ScatterND-ed into the causal mask, computed whole.
    "ts_llama_tf446_gqa",
    # transformers 4's experts loop: each expert's tokens picked by NonZero (test_moe_loop.py).
    "ts_olmoe_tf4_moe",
    "dynamo_olmoe_tf4_moe",
    # Sorting dispatches: every (token, slot) sorted by its expert, cut by the experts' counts
    # (test_sorted_experts.py); JetMoE's attention heads are experts too.
    "dynamo_jetmoe_tiny",
    "dynamo_granitemoe_tf4",
    # Opset 14: each length read is a Shape and a Gather (test_opset14.py).
    "ts_stablelm_opset14",
    # A sliding window of 4 keys in every layer, shorter than the lengths verified.
    "ts_mistral_window",
    "dynamo_mistral_window",
    # A sliding-window layer, then a full one, each with its rotary table (Gemma 3).
    "ts_gemma3_window",
    "dynamo_gemma3_window",
    # A mixture of experts beside a shared expert that every token runs through.
    "dynamo_qwen2_moe_tiny",
    # An encoder with a local layer (a window of 2 positions each side); under transformers
    # 4.57 its window is built from a Range over its global mask's length (test_window_positions).
    "ts_modernbert_tiny",
    "dynamo_modernbert_tiny",
    "ts_modernbert_tf4",
]
# The mixtures of experts among them: each token's experts (top 2) run on its rank's slice.
TOP_K = {
    "ts_qwen3_moe_tiny": 2,
    "dynamo_mixtral_moe_tiny": 2,
    "dynamo_qwen2_moe_tiny": 2,
    "dynamo_deepseek_v3_tiny": 2,
    "ts_deepseek_v3_tiny": 2,
    "dynamo_phimoe_tiny": 2,
    "dynamo_jetmoe_tiny": 2,
    "dynamo_granitemoe_tf4": 2,
}
# Where the Polygraphy format already splits everything: gen writes no extension.
PLAIN_SPLITS = [
    "ts_llama_tiny_gqa",
    "ts_gpt2_tiny",
    "ts_bert_tiny",
    "ts_qwen3_moe_tiny",
    "ts_mobilebert_tiny",
    "ts_gemma3_window",
]


def default_plan(name: str, tmp_path: Path) -> tuple[Path, Path | None]:
    """gen's hints of ``name`` and the extension written beside them (None when none)."""
    return gen_plan(REAL / f"{name}.onnx", tmp_path)


@pytest.mark.parametrize("name", SPLIT_BY_DEFAULT)
def test_the_default_plan_splits_the_projections_and_stays_exact(name: str, tmp_path: Path) -> None:
    hints, extension = default_plan(name, tmp_path)
    plan_file = extension or hints
    plan = make_plan(load_index(REAL / f"{name}.onnx"), read_hints(plan_file))
    assert plan.classes["projections"].share_on_slices >= 0.95
    # Counted again, independently, on the multi-device model shard writes.
    multi_device = tmp_path / "md.onnx"
    result = run_cli("shard", REAL / f"{name}.onnx", plan_file, "-o", multi_device)
    assert result.exit_code == 0, result.stderr
    assert projection_share_on_slices(multi_device, TOP_K.get(name, 1)) >= 0.95
    assert_verified_at_two_and_four_ranks(REAL / f"{name}.onnx", plan_file)


@pytest.mark.parametrize("name", PLAIN_SPLITS)
def test_no_extension_where_the_hints_split_everything(name: str, tmp_path: Path) -> None:
    _, extension = default_plan(name, tmp_path)
    assert extension is None


def test_the_hints_beside_an_extension_are_those_of_no_extension(tmp_path: Path) -> None:
    model = REAL / "dynamo_llama_tiny_gqa.onnx"
    hints, extension = default_plan("dynamo_llama_tiny_gqa", tmp_path)
    assert extension is not None
    alone = tmp_path / "alone.json"
    assert run_cli("gen", model, "-o", alone, "--no-extension", "-q").exit_code == 0
    assert hints.read_bytes() == alone.read_bytes()
    assert not (tmp_path / "alone.shardcheck.json").exists()


def test_polygraphy_loads_and_shards_the_hints_beside_an_extension(tmp_path: Path) -> None:
    multi_device = pytest.importorskip("polygraphy.tools.multi_device")
    tools = pytest.importorskip("polygraphy.tools")
    model = REAL / "dynamo_llama_tiny_gqa.onnx"
    hints, extension = default_plan("dynamo_llama_tiny_gqa", tmp_path)
    assert extension is not None
    loaded = multi_device.ShardHints.load(str(hints))
    assert [t.name for t in loaded.inputs] == [
        t["name"] for t in json.loads(hints.read_text())["inputs"]
    ]
    out = tmp_path / "polygraphy.onnx"
    code = tools.main(["multi-device", "shard", str(model), "-s", str(hints), "-o", str(out)])
    assert code in (0, None)
    assert out.exists()


@pytest.fixture(scope="module")
def extensions_written(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, Path]]:
    """Every real export gen writes an extension for, with that extension (gen runs once per
    module, not once per setting below)."""
    directory = tmp_path_factory.mktemp("extensions")
    written = []
    for model in sorted(REAL.glob("*.onnx")):
        _, extension = default_plan(model.stem, directory)
        if extension is not None:
            written.append((model.stem, extension))
    return written


# The lengths a model runs at, where verify's defaults are not: TorchScript traced the
# Transformer's decoder at a target length of its own (gen's SC002 warning names both).
TRUTH = read_json(REAL / "TRUTH.json")
RUNS_AT = {"ts_transformer_seq2seq": ("--seq-lens", "8,16", "--seq-len", "target=4,8")}


@pytest.mark.parametrize(("ranks", "batch"), [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_every_extension_gen_writes_is_exact(
    extensions_written: list[tuple[str, Path]], ranks: int, batch: int
) -> None:
    # verify's simulation on every real export gen writes one for (at the length it runs at,
    # for those that run at their traced length only); the fp16 exports within fp16's
    # tolerances. Those of SPLIT_BY_DEFAULT are verified at these settings above.
    names = {name for name, _ in extensions_written}
    assert {"dynamo_llama_tiny_gqa", "dynamo_gpt2_tiny", "dynamo_mpt_tiny"} <= names
    others = [(n, e) for n, e in extensions_written if n not in SPLIT_BY_DEFAULT]
    assert others, "every extension is of SPLIT_BY_DEFAULT: nothing left to verify here"
    for name, extension in others:
        if batch not in TRUTH[name].get("batches", (1, 2)):
            continue  # onnxruntime runs it at batch 1 only (test_rotary_op.py)
        result = run_cli(
            "verify", REAL / f"{name}.onnx", extension, "--ranks", ranks,
            "--dim", f"batch={batch}", "-q", *RUNS_AT.get(name, ()),
            "--rtol", "1e-2" if "fp16" in name else "1e-4",
            "--atol", "1e-2" if "fp16" in name else "1e-5",
        )  # fmt: skip
        assert result.exit_code == 0, (name, ranks, batch, result.stdout)
