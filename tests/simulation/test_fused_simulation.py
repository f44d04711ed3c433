"""The fused multi-device Attention simulated with its CP meaning, and gen's fused hints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, read_json, run_cli
from onnx import helper

from shardcheck.simulation.fused_attention import FusedAttentionStep, run_fused_attention
from shardcheck.simulation.rank_values import RankValues
from shardcheck.simulation.simulate import simulate
from shardcheck.verification.verify import verify

REAL = FIXTURES / "real"
# An encoder; a causal layer (SDPA, is_causal); HF GPT-2 and HF Llama with grouped KV heads
# called with input_ids alone (causal masks only); GPT-2 with its attention_mask input, whose
# mask is causal and padding (stays native).
ENCODER, CAUSAL, PADDED = (
    REAL / "ts_transformer_encoder.onnx",
    REAL / "ts_sdpa_causal.onnx",
    REAL / "ts_gpt2_tiny.onnx",
)
DECODER, GROUPED_KV = REAL / "dynamo_gpt2_causal_ids.onnx", REAL / "ts_llama_gqa_causal_ids.onnx"


def fused_hints(model: Path, tmp_path: Path, nb_rank: int) -> Path:
    hints = tmp_path / f"{model.stem}.{nb_rank}.json"
    result = run_cli("gen", model, "--cp-type", "fused", "--nb-rank", nb_rank, "-o", hints)
    assert result.exit_code == 0, result.stderr
    return hints


def test_gen_infers_each_layers_replacement(tmp_path: Path) -> None:
    causal = read_json(fused_hints(CAUSAL, tmp_path, 2))["attention_layers"]
    encoder = read_json(fused_hints(ENCODER, tmp_path, 2))["attention_layers"]
    for layers, is_causal in ((causal, True), (encoder, False)):
        assert layers and all(layer["gather_kv"] is False for layer in layers)
        # MatMul(q, k): k is [batch, heads, head_dim, seq]; q and v are in place.
        assert {
            (r["is_causal"], r["q_shuffle"], tuple(r["k_shuffle"]), r["v_shuffle"], r["nb_rank"])
            for r in (layer["replace"] for layer in layers)
        } == {(is_causal, None, (0, 1, 3, 2), None, 2)}


def test_a_layer_with_a_padding_mask_stays_native_with_a_warning(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    result = run_cli("gen", PADDED, "--cp-type", "fused", "-o", hints)
    assert "2 attention layers of 2 cannot be replaced by a fused attention and stay native" in (
        result.stderr
    )
    assert "a causal mask combined with another" in result.stderr
    layers = read_json(hints)["attention_layers"]
    assert all(layer["replace"] is None and layer["gather_kv"] for layer in layers)


def test_compat_polygraphy_copies_the_options_to_every_layer(tmp_path: Path) -> None:
    hints = tmp_path / "h.json"
    run_cli("gen", ENCODER, "--cp-type", "fused", "--compat", "polygraphy", "-o", hints)
    # Polygraphy's replacement is the options' (no shuffle given: none), on both layers.
    replacements = [layer["replace"] for layer in read_json(hints)["attention_layers"]]
    assert len(replacements) == 2
    assert all(r["k_shuffle"] is None and r["is_causal"] is False for r in replacements)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize(
    "model",
    [ENCODER, CAUSAL, DECODER, GROUPED_KV],
    ids=["encoder", "causal", "decoder", "grouped-kv"],
)
def test_fused_hints_pass_verify_with_ranks(model: Path, ranks: int, tmp_path: Path) -> None:
    hints = fused_hints(model, tmp_path, ranks)
    # Every layer is replaced: the simulation ran the fused op, not native CP.
    assert all(layer["replace"] for layer in read_json(hints)["attention_layers"])
    report = verify(model, hints, ranks=ranks)
    assert report.ok, report.render_text()
    assert any(f.code == "SC202" for f in report.findings)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("model", [CAUSAL, GROUPED_KV], ids=["causal", "grouped-kv"])
def test_causal_fused_simulation_is_exact_on_every_rank(
    model: Path, batch: int, ranks: int, tmp_path: Path
) -> None:
    # Every rank's output is compared with its slice of the single-device run: a wrong query
    # offset would mask the wrong keys on every rank but the first.
    result = simulate(
        model,
        fused_hints(model, tmp_path, ranks),
        ranks=ranks,
        seq_len=16,
        dims={"batch": batch},
        rtol=0,
        atol=1e-6,
    )
    assert result.ok, result.summary()


def _step(is_causal: bool, nb_rank: int) -> FusedAttentionStep:
    node = helper.make_node("Attention", ["q", "k", "v"], ["o"], name="fused")
    return FusedAttentionStep(node, is_causal=is_causal, scale=0.5, nb_rank=nb_rank)


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """Attention over the whole sequence, written out by hand, one query at a time."""
    out = np.zeros_like(q)
    for b, h, i in np.ndindex(q.shape[0], q.shape[1], q.shape[2]):
        seen = i + 1 if causal else k.shape[2]
        scores = np.array([0.5 * q[b, h, i] @ k[b, h // 2, j] for j in range(seen)])
        weights = np.exp(scores - scores.max())
        out[b, h, i] = (weights / weights.sum()) @ v[b, h // 2, :seen]
    return out


def _scattered(q: np.ndarray, k: np.ndarray, v: np.ndarray, ranks: int) -> RankValues:
    """Each rank's slices of Q, K and V along the sequence (axis 2)."""
    values = RankValues(ranks, {})
    parts = zip(*(np.split(t, ranks, axis=2) for t in (q, k, v)), strict=True)
    for rank, (q_part, k_part, v_part) in enumerate(parts):
        values.set_rank(rank, {"q": q_part, "k": k_part, "v": v_part})
    return values


@pytest.mark.parametrize("causal", [True, False])
def test_each_rank_attends_its_queries_to_every_ranks_keys_at_its_offset(causal: bool) -> None:
    # Grouped KV: 4 query heads share 2 K/V heads.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, h, 8, 4)).astype(np.float32) for h in (4, 2, 2))
    values = _scattered(q, k, v, 4)
    run_fused_attention(_step(causal, 4), values, 4)
    gathered = np.concatenate([values.per_rank[r]["o"] for r in range(4)], axis=2)
    np.testing.assert_allclose(gathered, _reference(q, k, v, causal), rtol=1e-5, atol=1e-6)


def test_nb_rank_1_attends_the_ranks_own_positions_only() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, h, 4, 4)).astype(np.float32) for h in (2, 1, 1))
    values = _scattered(q, k, v, 2)
    run_fused_attention(_step(True, 1), values, 2)
    np.testing.assert_allclose(
        values.per_rank[1]["o"],
        _reference(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], True),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("model", [ENCODER, GROUPED_KV], ids=["encoder", "grouped-kv"])
def test_nb_rank_1_on_one_rank_is_the_subgraph_it_replaced(model: Path, tmp_path: Path) -> None:
    result = simulate(model, fused_hints(model, tmp_path, 1), ranks=1, seq_len=8, rtol=0, atol=1e-6)
    assert result.ok, result.summary()


@pytest.mark.parametrize("ranks", [1, 2])
def test_pattern_1_replaced_with_the_layers_scale_is_the_subgraph(
    ranks: int, tmp_path: Path
) -> None:
    # Polygraphy's pattern 1 named by its Q before the scale: the Attention replaces the
    # Sqrt(1/Sqrt(8)) scales of Q and K too, and must apply 1/sqrt(8) itself.
    model, hints = FIXTURES / "sdpa_scaled_attention.onnx", tmp_path / "h.json"
    argv = ["--compat", "polygraphy", "--attention-pattern", "1", "--cp-type", "fused"]
    argv += ["--k-shuffle", "0,1,3,2", "--nb-rank", str(ranks)]
    assert run_cli("gen", model, *argv, "-o", hints).exit_code == 0
    assert read_json(hints)["attention_layers"][0]["q"] == "q"
    result = simulate(model, hints, ranks=ranks, seq_len=8, rtol=0, atol=1e-6)
    assert result.ok, result.summary()
