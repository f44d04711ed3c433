"""verify of fused hints: each field of a replacement checked against the layer and the ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, read_json, run_cli

REAL = FIXTURES / "real"
CAUSAL = REAL / "ts_sdpa_causal.onnx"
FIELD = "attention_layers[q=/Mul_output_0].replace"


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(replace: dict[str, Any]) -> None:
        replace[key] = value

    return mutate


# mutation -> (the change to the layer's replace, the code, the field named)
MUTATIONS = {
    "flipped is_causal": (_set("is_causal", False), "SC124", f"{FIELD}.is_causal"),
    "no k_shuffle": (_set("k_shuffle", None), "SC112", f"{FIELD}.k_shuffle"),
    "a q_shuffle that moves the heads": (
        _set("q_shuffle", [0, 2, 1, 3]),
        "SC112",
        f"{FIELD}.q_shuffle",
    ),
    "nb_rank unlike the ranks": (_set("nb_rank", 4), "SC126", f"{FIELD}.nb_rank"),
}


@pytest.fixture(scope="module")
def causal_hints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("fused") / "h.json"
    made = run_cli("gen", CAUSAL, "--cp-type", "fused", "--nb-rank", "2", "-o", path)
    assert made.exit_code == 0, made.stderr
    return read_json(path)


def test_the_hints_gen_writes_pass_and_name_the_layer_by_its_q(
    causal_hints: dict[str, Any], tmp_path: Path
) -> None:
    (layer,) = causal_hints["attention_layers"]
    assert f"attention_layers[q={layer['q']}].replace" == FIELD
    assert run_cli("verify", CAUSAL, _write(causal_hints, tmp_path), "--ranks", "2").exit_code == 0


def _write(hints: dict[str, Any], directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / "fused_hints.json"
    path.write_text(json.dumps(hints))
    return path


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_fused_mutation_fails_naming_the_field(
    mutation: str, causal_hints: dict[str, Any], tmp_path: Path
) -> None:
    mutate, code, field = MUTATIONS[mutation]
    hints = json.loads(json.dumps(causal_hints))
    mutate(hints["attention_layers"][0]["replace"])
    path = _write(hints, tmp_path)
    result = run_cli("verify", CAUSAL, path, "--ranks", "2", "--format", "json")
    assert result.exit_code == 1, result.stdout
    report = json.loads(result.stdout)
    found = [(f["code"], f["field"]) for f in report["findings"] if f["level"] == "error"]
    assert (code, field) in found, found


def test_a_replacement_that_drops_a_padding_mask_is_an_error(tmp_path: Path) -> None:
    # GPT-2's layers add the attention_mask input's padding to their causal mask; --is-causal
    # tells gen to replace them anyway.
    model, path = REAL / "ts_gpt2_tiny.onnx", tmp_path / "h.json"
    made = run_cli("gen", model, "--cp-type", "fused", "--is-causal", "-o", path)
    assert "replaced as the fused options say" in made.stderr
    result = run_cli("verify", model, path, "--format", "json")
    assert result.exit_code == 1
    found = {(f["code"], f["field"]) for f in json.loads(result.stdout)["findings"]}
    assert ("SC128", "attention_layers[q=/model/h.0/attn/Mul_output_0].replace") in found, found


def test_polygraphys_scale_is_reported_where_the_layer_applies_another(tmp_path: Path) -> None:
    # scaled_masked_attention divides its scores by 4 between the MatMul and the Softmax.
    model = FIXTURES / "scaled_masked_attention.onnx"
    hints = read_json(FIXTURES.parent / "golden" / "scaled_masked_attention.json")
    hints["attention_layers"][0].update(
        gather_kv=False,
        replace={"is_causal": False, "nb_rank": 1, "polygraphy_class": "FusedAttention"},
    )
    path = _write(hints, tmp_path)
    findings = json.loads(run_cli("verify", model, path, "--format", "json").stdout)["findings"]
    (scale,) = [f for f in findings if f["code"] == "SC127"]
    assert (scale["expected"], scale["level"]) == ("0.25", "warning")


def test_polygraphys_pattern_1_hints_are_checked_and_its_scale_reported(tmp_path: Path) -> None:
    # Polygraphy names the layer by its Q before the Sqrt scales, which its replacement drops.
    model, path = FIXTURES / "sdpa_scaled_attention.onnx", tmp_path / "h.json"
    argv = ["--compat", "polygraphy", "--attention-pattern", "1", "--cp-type", "fused"]
    assert run_cli("gen", model, *argv, "--k-shuffle", "0,1,3,2", "-o", path).exit_code == 0
    result = run_cli("verify", model, path, "--ranks", "1", "--format", "json")
    assert result.exit_code == 0, result.stdout
    findings = json.loads(result.stdout)["findings"]
    (scale,) = [f for f in findings if f["code"] == "SC127"]
    assert (scale["field"], scale["expected"]) == ("attention_layers[q=q].replace", "0.353553")
    # 1 / sqrt(8), the head_dim of Q's last axis.
    assert float(scale["expected"]) == pytest.approx(8**-0.5, rel=1e-5)
