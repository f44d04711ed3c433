"""Attention detection on real exports, checked against fixtures/real/TRUTH.json.

TRUTH.json was written from the PyTorch model definitions and confirmed by onnxruntime runs at
two sequence lengths when the fixtures were built; it is not shardcheck's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx.inliner
import pytest
from conftest import FIXTURE_MODELS, FIXTURES

from shardcheck import AttentionLayer, detect_attention, load_index
from shardcheck.analysis.detect import layer_tensors
from shardcheck.graph.index import GraphIndex

REAL = FIXTURES / "real"
TRUTH = json.loads((REAL / "TRUTH.json").read_text())


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_every_layer_found_with_its_q_k_v_and_axes(name: str) -> None:
    truth = TRUTH[name]
    index = load_index(REAL / truth["file"])
    if "attention_in_functions" in truth:  # the truth names the tensors of an inlined copy
        index = GraphIndex(onnx.inliner.inline_local_functions(index.model))
    layers = detect_attention(index)
    assert len(layers) == truth["attention_layers"]
    for expected, layer in zip(truth["attention_nodes"], layers, strict=True):
        if expected.get("fused"):
            assert layer.kind == "fused"
            assert (layer.q, layer.gathered_k, layer.gathered_v) == (
                expected["q_tensor"],
                expected["k_tensor"],
                expected["v_tensor"],
            )
        else:
            assert layer.kind == "decomposed"
            assert layer.q == expected["scores_matmul"]["inputs"][0] == expected["q_tensor"]
            assert layer.gathered_k == expected["scores_matmul"]["inputs"][1]
            assert layer.gathered_v == expected["probs_matmul"]["inputs"][1]
            assert layer.output == expected["probs_matmul"]["output"]
        # Where Q, K or V carry no sequence (a cross-attention's context, Perceiver's
        # latents, Funnel's pooled or DETR's object queries in a fixed-length model), the axis
        # of the context's, the latents' or that own length (measured too).
        axes = [
            next(
                (
                    expected.get(f"{role}_{kind}_axis")
                    for kind in ("seq", "context", "latent", "own")
                    if expected.get(f"{role}_{kind}_axis") is not None
                ),
                None,
            )
            for role in "qkv"
        ]
        assert [layer.q_axis, layer.k_axis, layer.v_axis] == axes
        whole_kv = [expected.get(f"k_{kind}_axis") for kind in ("context", "latent")]
        assert (layer.kv_context is not None) == (whole_kv != [None, None])
        assert (layer.latents is not None) == ("q_latent_axis" in expected)


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_causal_mask_found_exactly_where_the_model_is_causal(name: str) -> None:
    truth = TRUTH[name]
    layers = detect_attention(load_index(REAL / truth["file"]))
    expected = truth.get("causal_layers", [truth["causal"]] * len(layers))
    assert [layer.causal is not None for layer in layers] == expected, [
        layer.causal for layer in layers
    ]


def test_causal_mask_says_how_it_is_built() -> None:
    trilu = detect_attention(load_index(REAL / "ts_sdpa_causal.onnx"))[0]
    assert trilu.causal == "Trilu node /Trilu"
    ranged = detect_attention(load_index(REAL / "ts_gpt2_tiny.onnx"))[0]
    assert ranged.causal is not None and ranged.causal.startswith("Range comparison node")


def test_polygraphy_recognition_is_recorded() -> None:
    # Polygraphy's pattern 0 is MatMul -> Softmax -> MatMul with nothing between: plain SDPA
    # decompositions match it, HF's masked and guarded attention does not.
    assert detect_attention(load_index(REAL / "ts_sdpa.onnx"))[0].polygraphy_patterns == (0,)
    assert detect_attention(load_index(REAL / "ts_bert_tiny.onnx"))[0].polygraphy_patterns == ()
    both = detect_attention(load_index(FIXTURES / "sdpa_scaled_attention.onnx"))[0]
    assert both.polygraphy_patterns == (0, 1)


def test_hand_made_masked_attention_is_found_with_its_mask() -> None:
    layer = detect_attention(load_index(FIXTURES / "scaled_masked_attention.onnx"))[0]
    assert (layer.q, layer.gathered_k, layer.gathered_v) == ("q", "k_T", "v")
    assert layer.masks == ("mask",)
    assert layer.polygraphy_patterns == ()


def test_no_attention_in_an_mlp() -> None:
    assert detect_attention(load_index(FIXTURES / "no_attention.onnx")) == []


def test_fused_com_microsoft_multihead_attention_is_a_layer() -> None:
    layer = detect_attention(load_index(FIXTURES / "ms_multihead_attention.onnx"))[0]
    assert (layer.kind, layer.op_type) == ("fused", "com.microsoft.MultiHeadAttention")
    assert (layer.q, layer.gathered_k, layer.gathered_v, layer.output) == ("q", "k", "v", "context")
    # [batch, seq, hidden] inputs: the sequence is axis 1 of Q, K and V alike.
    assert (layer.q_axis, layer.k_axis, layer.v_axis) == (1, 1, 1)


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=[p.stem for p in FIXTURE_MODELS])
def test_layer_tensors_without_shapes_are_the_tensors_detection_finds(model: Path) -> None:
    """verify starts onnxruntime on the tensors found without shape inference: they must be the
    very tensors that full detection finds, layer by layer."""
    index = load_index(model)

    def tensors(layer: AttentionLayer) -> tuple[object, ...]:
        return (layer.name, layer.q, layer.gathered_k, layer.gathered_v, layer.masks, layer.output)

    early = layer_tensors(index)
    assert [tensors(layer) for layer in early] == [
        tensors(layer) for layer in detect_attention(index)
    ]
    # No shapes, so no ranks, nor axes but those an Einsum's equation gives.
    assert all(layer.k_rank is None and layer.causal is None for layer in early)
    assert all(layer.q_axis is None for layer in early if "Einsum" not in layer.op_type)


def test_a_mask_sized_by_a_shape_is_not_causal_for_what_computed_that_shape(
    tmp_path: Path,
) -> None:
    """Layer 2's padding mask is expanded to the Shape of layer 1's probabilities, which a
    Trilu mask made causal. A Shape passes on only its input's shape: layer 1 is causal,
    layer 2 is not."""
    import onnx
    from onnx import TensorProto, helper

    def layer(n: int, x: str, mask: str) -> list[onnx.NodeProto]:
        return [
            helper.make_node("Transpose", [x], [f"k_T{n}"], name=f"t{n}", perm=[1, 0]),
            helper.make_node("MatMul", [x, f"k_T{n}"], [f"s{n}"], name=f"scores{n}"),
            helper.make_node("Add", [f"s{n}", mask], [f"m{n}"], name=f"mask{n}"),
            helper.make_node("Softmax", [f"m{n}"], [f"p{n}"], name=f"softmax{n}"),
            helper.make_node("MatMul", [f"p{n}", x], [f"y{n}"], name=f"context{n}"),
        ]

    nodes = [
        helper.make_node("Trilu", ["bias"], ["causal"], name="trilu", upper=1),
        *layer(1, "x", "causal"),
        helper.make_node("Shape", ["p1"], ["p1_shape"], name="shape"),
        helper.make_node("Expand", ["padding", "p1_shape"], ["padding_2d"], name="expand"),
        *layer(2, "y1", "padding_2d"),
    ]
    graph = helper.make_graph(
        nodes,
        "two_layers",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", 4]),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["seq", "seq"]),
            helper.make_tensor_value_info("padding", TensorProto.FLOAT, [1, "seq"]),
        ],
        [helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["seq", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / "two_layers.onnx"
    onnx.save(model, path)

    first, second = detect_attention(load_index(path))
    assert first.causal == "Trilu node trilu"
    assert second.masks == ("padding_2d",)
    assert second.causal is None


@pytest.mark.parametrize(
    ("name", "sink", "causal_mask"),
    [
        (
            "ts_gptoss_sinks",
            "/model/layers.0/self_attn/Expand_2_output_0",
            "/model/Where_3_output_0",
        ),
        ("dynamo_gptoss_sinks", "expand_4", "where_1"),
    ],
)
def test_attention_sinks_are_found_beside_the_scores(
    name: str, sink: str, causal_mask: str
) -> None:
    # GPT-OSS: Concat(scores + mask, sinks) on the Softmax's axis, minus its ReduceMax, then
    # the sinks' column Sliced off before the context MatMul (tensor names read off the graph).
    index = load_index(REAL / f"{name}.onnx")
    first = detect_attention(index)[0]
    assert first.sinks == (sink,)
    # The running max subtracted for stability is no mask; the sink is combined as one is.
    assert first.masks == (causal_mask, sink)
    assert index.producer_of(sink).op_type == "Expand"
    # Found without shapes too: what verify names SC108 against.
    assert [layer.q for layer in layer_tensors(index)] == [
        layer.q for layer in detect_attention(index)
    ]
