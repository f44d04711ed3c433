"""explain's figures, checked against counts worked out by hand from each model's shapes.

The counting rules are docs/commands.md's ("explain"): a product of [M, K] by [K, N] is 2·M·N·K
FLOPs, an elementwise op or a softmax one per output element, data movement none. Batch 1,
float32 (4 bytes), N = 2 ranks; a collective moves (N-1)/N of its whole tensor to each rank.
"""

from __future__ import annotations

import json

import onnx
import pytest
from conftest import FIXTURES, checked_model, run_cli
from onnx import TensorProto, helper, numpy_helper

from shardcheck.analysis.detect import detect_attention
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import InputError
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.loader import load_index
from shardcheck.hints.model import ShardHints, ShardTensor
from shardcheck.planning.flop_count import count_flops
from shardcheck.planning.plan import make_plan

REAL = FIXTURES / "real"
S = 64
N = 2
FLOAT = 4


def _plan(path, seq_len=S, ranks=N):  # type: ignore[no-untyped-def]
    index = load_index(path)
    return make_plan(index, generate(index, GenOptions()).hints, seq_len=seq_len, ranks=ranks)


def _weight_dims(path, name):  # type: ignore[no-untyped-def]
    model = onnx.load(str(path))
    return next(list(t.dims) for t in model.graph.initializer if t.name == name)


def test_attention_head_by_hand() -> None:
    """input [1, S, D] -> three projections by [D, D] -> q @ k^T -> Softmax -> @ v."""
    path = FIXTURES / "attention_head.onnx"
    d = _weight_dims(path, "W_q")[0]
    assert d == 16
    projections = 3 * 2 * S * d * d  # three [S, D] x [D, D]
    attention = 2 * S * S * d + S * S + 2 * S * S * d  # scores, softmax, context
    plan = _plan(path)
    assert plan.classes["projections"].on_slices == projections
    assert plan.classes["projections"].whole == 0
    assert plan.classes["attention"].on_slices == attention
    assert plan.classes["other"].total == 0
    assert plan.flops_on_slices == 1.0
    assert plan.flops_per_rank == (projections + attention) // N
    assert plan.speedup_bound == pytest.approx(2.0)
    # Bytes: the scatter of input, the gathers of k^T and v, the gather of the output; each
    # whole tensor is [S, D] floats, of which a rank receives half.
    received = {c.role: c.bytes_received for c in plan.collectives}
    assert received == {
        role: S * d * FLOAT // N for role in ("scatter", "gather K", "gather V")
    } | {"gather output": S * d * FLOAT // N}
    # Peak on one device: while the Softmax runs, its scores and probabilities [S, S] and v.
    assert plan.peak_bytes_one_device == (2 * S * S + S * d) * FLOAT
    # On a rank: scores and probabilities of its S/N queries, and the gathered v [S, D].
    assert plan.peak_bytes_per_rank == (2 * (S // N) * S + S * d) * FLOAT


def _heads(path):  # type: ignore[no-untyped-def]
    """The heads of ts_sdpa's head split: the Reshape target's constant [.., .., H, ..]."""
    model = onnx.load(str(path))
    constant = next(n for n in model.graph.node if n.output[0] == "/Constant_7_output_0")
    return int(numpy_helper.to_array(constant.attribute[0].t).reshape(-1)[0])


def test_sdpa_by_hand() -> None:
    """x [1, S, D] -> q, k, v projections with biases -> heads H -> scaled q and k -> scores,
    softmax, context -> out projection with bias; everything split but 7 scalar ops on the
    head size (3 Divs of the width by the heads, the scale's Sqrt and Div, its 2 Sqrts)."""
    path = REAL / "ts_sdpa.onnx"
    d = _weight_dims(path, "onnx::MatMul_128")[0]
    h = _heads(path)
    assert (d, h) == (32, 2)
    projections = 4 * 2 * S * d * d
    attention = 2 * S * S * d + h * S * S + 2 * S * S * d  # per head: 2·S·S·(D/H), H heads
    other_sliced = 4 * S * d + 2 * S * d  # four bias Adds, the scales of q and k
    other_whole = 7
    plan = _plan(path)
    assert plan.classes["projections"].on_slices == projections
    assert plan.classes["attention"].on_slices == attention
    assert (plan.classes["other"].on_slices, plan.classes["other"].whole) == (
        other_sliced,
        other_whole,
    )
    total = projections + attention + other_sliced + other_whole
    assert plan.flops_total == total
    assert plan.flops_on_slices == pytest.approx((total - other_whole) / total)
    assert plan.flops_per_rank == (total - other_whole) // N + other_whole
    # x, K, V and y are each S·D floats whole.
    assert plan.bytes_received == 4 * S * d * FLOAT // N


def test_sdpa_causal_by_hand() -> None:
    """The same layer with a causal mask sized by q's Shape: the hints cut after the
    projections, so they run whole on every rank; the core, the mask's Add inside it and
    q's scale run on slices."""
    path = REAL / "ts_sdpa_causal.onnx"
    d = _weight_dims(path, "onnx::MatMul_145")[0]
    h = 2
    projections = 4 * 2 * S * d * d
    # scores, the mask's Add, softmax, context
    attention = 2 * S * S * d + h * S * S + h * S * S + 2 * S * S * d
    q_scale = S * d
    # four bias Adds and k's scale, whole; the mask's Trilu, Equal and Where [S, S]; 7 scalars
    other_whole = 4 * S * d + S * d + 3 * S * S + 7
    plan = _plan(path)
    assert plan.classes["projections"].whole == projections
    assert plan.classes["projections"].on_slices == 0
    assert plan.classes["attention"].on_slices == attention
    assert plan.classes["other"].on_slices == q_scale
    assert plan.classes["other"].whole == other_whole
    total = projections + attention + q_scale + other_whole
    assert plan.flops_on_slices == pytest.approx((attention + q_scale) / total)
    assert plan.flops_per_rank == (attention + q_scale) // N + projections + other_whole


# The mixtures of experts of fixtures/real: a token's top-2 experts, each of their products
# [1, K] by the expert's [K, N] (2·K·N FLOPs) for each of the S·2 (token, expert) pairs.
MOE_EXPERTS = {
    # TorchScript: each token's experts' weights a Gather of the stacked [E, N, K] weights.
    "ts_qwen3_moe_tiny": (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ),
    # dynamo (batched_mm): a GatherND of them.
    "dynamo_mixtral_moe_tiny": ("val_266", "val_275"),
}


@pytest.mark.parametrize("name", sorted(MOE_EXPERTS))
def test_the_experts_are_counted_as_mlp_work_by_hand(name: str) -> None:
    """Per layer: q and o [32, 32], k and v [32, 16] (4 query, 2 K/V heads of 8), the router
    [32, 4 experts], and the experts' two products per routed token; 2 layers. explain counts
    it all as projections and MLP, on slices."""
    path = REAL / f"{name}.onnx"
    gate_up, down = (_weight_dims(path, weight) for weight in MOE_EXPERTS[name])
    experts, top_k = 4, 2
    assert gate_up[0] == down[0] == experts
    attention_projections = 2 * S * 32 * (32 + 16 + 16 + 32)
    router = 2 * S * 32 * experts
    routed = S * top_k
    expert_products = routed * (2 * gate_up[1] * gate_up[2] + 2 * down[1] * down[2])
    if name == "ts_qwen3_moe_tiny":  # intermediate 32: gate and up [64, 32], down [32, 32]
        assert expert_products == 128 * (2 * 64 * 32 + 2 * 32 * 32) == 786432
    else:  # intermediate 64: gate and up [128, 32], down [32, 64]
        assert expert_products == 128 * (2 * 128 * 32 + 2 * 32 * 64) == 1572864
    by_hand = 2 * (attention_projections + router + expert_products)
    result = run_cli("explain", path, "--seq-len", S, "--format", "json")
    assert result.exit_code == 0, result.stderr
    projections = json.loads(result.stdout)["plan"]["flops"]["by_class"]["projections"]
    assert projections == {"on_slices": by_hand, "whole": 0, "share_on_slices": 1.0}


def test_four_ranks_divide_the_slices_by_four() -> None:
    path = FIXTURES / "attention_head.onnx"
    two, four = _plan(path, ranks=2), _plan(path, ranks=4)
    assert four.flops_total == two.flops_total
    assert four.flops_per_rank == two.flops_total // 4
    assert four.speedup_bound == pytest.approx(4.0)


def test_a_cut_inside_the_layers_names_what_blocks_it() -> None:
    plan = _plan(REAL / "dynamo_llama_tiny_gqa.onnx")
    assert plan.classes["projections"].share_on_slices == 0.0
    # The rotary positions are sized by the padding mask's length, read before any cut
    # (node_Shape_2: Shape(attention_mask, start=1, end=2)); its batch, read by node_Shape_1
    # too, is no length and blocks nothing.
    assert plan.blockers[0].what == "positions are computed from attention_mask.shape[1]"
    assert plan.blockers[0].node == "node_Shape_2"
    assert plan.blockers[0].fix == "export with position_ids as a graph input"


def test_a_read_of_the_batch_is_named_as_no_blocker() -> None:
    """dynamo DeiT reads pixel_values.shape[0], its batch, to size its mask's batch: that
    read keeps no work whole (its tokens are fixed by the image size), so it is not named."""
    plan = _plan(REAL / "dynamo_deit_tiny.onnx", seq_len=None)
    assert plan.classes["projections"].share_on_slices < 1.0
    assert all("pixel_values" not in blocker.what for blocker in plan.blockers)
    # What does keep them whole: the exporter spells the 16 tokens into each head split (hidden
    # 32 as 4 heads of 8), which a rank's 8 tokens cannot take; this one is the first.
    assert [(b.what, b.fix) for b in plan.blockers] == [
        (
            "the length 16 is spelled in the target of Reshape node_Reshape_194 ([-1, 16, 4, 8])",
            "export with a dynamic sequence axis",
        )
    ]


def test_a_causal_mask_sized_by_q_is_named() -> None:
    """ts_sdpa_causal builds its mask from the Shape of q (/Shape_13 of /Transpose_output_0):
    q cannot be scattered before that read, so its projection runs whole."""
    plan = _plan(REAL / "ts_sdpa_causal.onnx")
    mask = [b for b in plan.blockers if b.what.startswith("the attention mask")]
    assert [b.tensor for b in mask] == ["/Transpose_output_0"]
    assert mask[0].node == "/Shape_13"


def test_a_full_split_names_no_blocker() -> None:
    assert _plan(REAL / "ts_bert_tiny.onnx").blockers == ()


def test_explain_json_has_the_plan() -> None:
    result = run_cli(
        "explain", FIXTURES / "attention_head.onnx", "--seq-len", S, "--format", "json"
    )
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["flops_on_slices"] == 1.0
    assert plan["seq_len"] == S and plan["ranks"] == N
    assert plan["flops"]["by_class"]["projections"]["on_slices"] == 3 * 2 * S * 16 * 16


def test_explain_with_hints_file_matches_the_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = REAL / "ts_sdpa_causal.onnx"
    hints = tmp_path / "hints.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    # gen's default plan for this block is the extension it writes beside the hints.
    extension = tmp_path / "hints.shardcheck.json"
    given = run_cli("explain", model, extension, "--seq-len", S, "--format", "json")
    default = run_cli("explain", model, "--seq-len", S, "--format", "json")
    assert given.exit_code == default.exit_code == 0
    given_plan, default_plan = json.loads(given.stdout)["plan"], json.loads(default.stdout)["plan"]
    assert (given_plan.pop("hints"), default_plan.pop("hints")) == (
        f"{extension} (shardcheck's extension)",
        f"gen's default hints of {model}, with the extension gen writes beside them",
    )
    assert given_plan == default_plan


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (("--seq-len", "63"), "not a multiple of 2"),
        (("--ranks", "0"), "--ranks 0"),
        (("--seq-len", "0"), "--seq-len 0"),
    ],
)
def test_explain_bad_settings_are_one_line(args: tuple[str, ...], wanted: str) -> None:
    result = run_cli("explain", REAL / "ts_bert_tiny.onnx", *args)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardcheck: error: ") and wanted in lines[0]


def test_explain_a_fixed_length_model_at_another_length_is_refused() -> None:
    result = run_cli("explain", REAL / "ts_vit_tiny.onnx", "--seq-len", "64")
    assert result.exit_code == 2
    assert "runs at length 17 only" in result.stderr
    at_its_length = run_cli("explain", REAL / "ts_vit_tiny.onnx")
    assert at_its_length.exit_code == 2  # 17 patches do not split in two
    assert "runs at this length only: give --ranks a divisor of it" in at_its_length.stderr
    whisper = run_cli("explain", REAL / "ts_whisper_encoder.onnx", "--format", "json")
    assert whisper.exit_code == 0 and json.loads(whisper.stdout)["plan"]["seq_len"] == 8


def test_gen_prints_the_plan_line_by_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """gen ends with the summary line of the plan it wrote, explain's first line; not with
    --no-plan, -q or --compat polygraphy, and the hints are the same bytes either way."""
    model = REAL / "ts_sdpa.onnx"
    shown = run_cli("gen", model, "-o", tmp_path / "a.json")
    explained = run_cli("explain", model, tmp_path / "a.json")
    assert shown.exit_code == explained.exit_code == 0
    first = explained.stdout.splitlines()[0]
    assert first.startswith(f"{model}: plan at length 4096 on 2 ranks: ")
    assert shown.stderr.splitlines() == [f"shardcheck: {first} ('shardcheck explain' says more)"]
    for name, options in (
        ("b", ["--no-plan"]),
        ("c", ["-q"]),
        ("d", ["--plan", "--compat", "polygraphy"]),
    ):
        quiet = run_cli("gen", model, *options, "-o", tmp_path / f"{name}.json")
        assert quiet.exit_code == 0
        assert "of FLOPs on slices" not in quiet.stderr, options
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "c.json").read_bytes()


def test_gen_says_the_plans_in_one_line_where_it_writes_an_extension(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The extension's line gives both plans' shares: no second line says the plan again.
    model = REAL / "dynamo_gpt2_tiny.onnx"
    result = run_cli("gen", model, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "h.shardcheck.json").is_file()
    lines = [line for line in result.stderr.splitlines() if "warning" not in line]
    assert lines == [
        f"shardcheck: {tmp_path / 'h.json'}: Polygraphy-compatible hints: 0.0% of the "
        "projection and MLP FLOPs on slices; 'shardcheck shard' with the extension "
        f"{tmp_path / 'h.shardcheck.json'}: 100.0%"
    ]


def test_explain_text_shows_names_escaped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Tensor and node names come from the file: one holding a newline and terminal escapes
    can neither forge a line of explain's text nor reach the terminal raw."""
    model = onnx.load(str(REAL / "ts_llama_tiny_gqa.onnx"))
    evil = "\x1b]0;owned\x07\nFORGED LINE"
    graph = model.graph
    kept = {i.name for i in graph.input} | {o.name for o in graph.output}
    renamed = {
        name: f"{name}{evil}"
        for node in graph.node
        for name in node.output
        if name and name not in kept
    }
    for node in graph.node:
        node.name = f"{node.name}{evil}"
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
    for info in graph.value_info:
        info.name = renamed.get(info.name, info.name)
    path = tmp_path / "evil.onnx"
    onnx.save(model, str(path))
    result = run_cli("explain", path, "--seq-len", S)
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert not any(line.startswith("FORGED") for line in result.stdout.splitlines())
    assert "\\x1b]0;owned\\x07\\nFORGED LINE" in result.stdout  # the names, shown escaped


def test_the_extensions_plan_counts_each_node_as_itself() -> None:
    """The extension's multi-device model of dynamo Llama drops some length computations and
    copies others, as many nodes as before but in another order: each node's count must be its
    own. HF Llama, hidden 32, MLP 64, 4 query heads / 2 KV heads of 8, 2 layers, batch 1."""
    path = REAL / "dynamo_llama_tiny_gqa.onnx"
    index = load_index(path)
    extension = generate(index, GenOptions()).extension
    assert extension is not None
    plan = make_plan(index, extension.hints, seq_len=S, ranks=N)
    hidden, mlp, heads, kv_heads, head = 32, 64, 4, 2, 8
    per_layer = (
        2
        * S
        * (
            hidden * hidden  # q
            + 2 * hidden * kv_heads * head  # k, v
            + hidden * hidden  # o
            + 3 * hidden * mlp  # gate, up, down
        )
    )
    assert plan.classes["projections"].on_slices == 2 * per_layer
    assert plan.classes["projections"].whole == 0
    # The core of each layer: its two products [heads, S, S] x 8, and one FLOP per score of
    # each of its other ops (the mask's Add, the Softmax, ...), as many as its nodes say.
    layers = detect_attention(index, ShapeInference(index))
    others = [sum(index.nodes[at].op_type != "MatMul" for at in layer.internal) for layer in layers]
    products = 2 * 2 * heads * S * S * head
    assert plan.classes["attention"].on_slices == sum(products + k * heads * S * S for k in others)
    assert plan.classes["attention"].whole == 0
    assert all(layer.q_local for layer in plan.layers)


def test_what_the_extension_computes_with_the_whole_length_counts_whole() -> None:
    """TorchScript's causal SDPA makes its mask [S, S] from the length of a slice: the
    extension computes it with the whole length on every rank, by copies of the nodes that
    make it, and scatters it. Those copies are the mask's whole work: its Trilu, Equal and
    Where, one FLOP per element each (its Expand moves data only)."""
    path = REAL / "ts_sdpa_causal.onnx"
    index = load_index(path)
    extension = generate(index, GenOptions()).extension
    assert extension is not None
    seq = 4096
    plan = make_plan(index, extension.hints, seq_len=seq, ranks=N)
    mask = 3 * seq * seq
    # The rest of what runs whole is of scalars and short vectors: less than a row.
    assert mask <= plan.classes["other"].whole < mask + seq
    total = sum(flops.total for flops in plan.classes.values())
    whole = sum(flops.whole for flops in plan.classes.values())
    assert plan.flops_on_slices == pytest.approx(1 - whole / total, abs=1e-6)
    assert plan.flops_on_slices < 1


def test_one_devices_peak_is_the_same_whatever_the_plan() -> None:
    """One device runs the model as it is, whichever plan it is compared with. The extension's
    multi-device model of TorchScript's causal SDPA drops the nodes making its mask [S, S]
    (float32), which only their copies with the whole length compute there: the mask must still
    count, as its first copy's. Counted over the multi-device model's tensors alone, one
    device's peak came out S·S·4 bytes lower with the extension than with the hints."""
    path = REAL / "ts_sdpa_causal.onnx"
    index = load_index(path)
    generated = generate(index, GenOptions())
    assert generated.extension is not None
    seq = 4096
    with_hints = make_plan(index, generated.hints, seq_len=seq, ranks=N)
    with_extension = make_plan(index, generated.extension.hints, seq_len=seq, ranks=N)
    assert with_extension.peak_bytes_one_device == with_hints.peak_bytes_one_device
    assert with_hints.peak_bytes_one_device >= seq * seq * FLOAT


def test_a_scattered_tensor_of_unknown_length_names_where_its_shape_is_lost() -> None:
    # TorchScript's MobileBERT pads its trigram embeddings by pads computed at run time: no
    # length makes the scattered tensor's positions known, so the error names the Pad rather
    # than asking for another length.
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad_by_input"),
        helper.make_node("MatMul", ["padded", "w"], ["out"], name="projection"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 4]),
            helper.make_tensor_value_info("pads", TensorProto.INT64, [6]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "padded", 4])],
        [helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [0.0] * 16)],
    )
    index = GraphIndex(checked_model(graph))
    hints = ShardHints(inputs=(ShardTensor("padded", 1, 3),), outputs=(ShardTensor("out", 1, 3),))
    for seq_len in (64, 4096):
        with pytest.raises(InputError) as refused:
            count_flops(index, ShapeInference(index), [], hints, seq_len=seq_len)
        message = str(refused.value)
        assert "'padded' has an unknown number of positions on axis 1" in message
        assert "not inferred past Pad pad_by_input" in message
        assert "pick a length" not in message


def test_explain_says_where_gens_plan_has_no_exact_cut(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The layer's output is a graph output gathered there, and also read by the residual Add
    # on the rank's slice: gen warns SC308, and verify's simulation does differ.
    model = FIXTURES / "attention_output_chain.onnx"
    result = run_cli("explain", model)
    assert result.exit_code == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("not exact:")]
    assert line.startswith("not exact: 1 place without an exact cut, first: attn_out is gathered")
    document = json.loads(run_cli("explain", model, "--format", "json").stdout)
    assert len(document["not_exact"]) == 1 and "attn_out" in document["not_exact"][0]
    hints = tmp_path / "h.json"
    assert run_cli("gen", model, "-o", hints, "-q").exit_code == 0
    assert run_cli("verify", model, hints, "-q").exit_code == 1
    # Hints given are not checked: nothing is said of them.
    given = json.loads(run_cli("explain", model, hints, "--format", "json").stdout)
    assert given["not_exact"] is None
    exact = json.loads(run_cli("explain", REAL / "ts_gpt2_tiny.onnx", "--format", "json").stdout)
    assert exact["not_exact"] == []
