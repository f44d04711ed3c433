"""``gen --compat polygraphy`` against Polygraphy 0.53.6 itself, used as an oracle.

Polygraphy is a test extra; it is imported only here. Its inputs/outputs order is random
(taken from a set), so lists are compared ordered by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ANCHORS, FIXTURES, read_json, run_cli, sorted_io
from parity_cases import ANCHOR_MODELS, OPTION_CASES, uses_pattern1
from parity_cases import FIXTURES as FIXTURE_NAMES

polygraphy_tools = pytest.importorskip("polygraphy.tools")
multi_device = pytest.importorskip("polygraphy.tools.multi_device")
import onnx_graphsurgeon  # noqa: E402

RECORDED = Path(__file__).parents[1] / "data" / "polygraphy_gs058"
GS_MATCHES_PATTERN1 = onnx_graphsurgeon.__version__.startswith("0.5.")


def polygraphy_hints(model: Path, args: list[str], out: Path) -> dict:
    code = polygraphy_tools.main(["template", "shard-hints", str(model), "-o", str(out), *args])
    assert code in (0, None)
    return read_json(out)


def shardcheck_hints(model: Path, args: list[str], out: Path) -> dict:
    result = run_cli("gen", model, "-o", out, "--compat", "polygraphy", *args)
    assert result.exit_code == 0, result.stderr
    return read_json(out)


def oracle(model: Path, name: str, case: str, args: list[str], tmp_path: Path) -> dict:
    if uses_pattern1(args) and not GS_MATCHES_PATTERN1:
        # graphsurgeon >= 0.6 never matches pattern 1; the oracle is Polygraphy under gs 0.5.8,
        # recorded by tests/oracle/record_gs058.py.
        return read_json(RECORDED / f"{name}.{case}.json")
    return polygraphy_hints(model, args, tmp_path / "polygraphy.json")


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_parity(name: str, case: str, tmp_path: Path) -> None:
    model = FIXTURES / f"{name}.onnx"
    args = OPTION_CASES[case]
    expected = oracle(model, name, case, args, tmp_path)
    ours = shardcheck_hints(model, args, tmp_path / "ours.json")
    assert sorted_io(ours) == sorted_io(expected)


@pytest.mark.skipif(not ANCHORS.is_dir(), reason="../shared/anchor-models is not present")
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
@pytest.mark.parametrize("name", ANCHOR_MODELS)
def test_anchor_model_parity(name: str, case: str, tmp_path: Path) -> None:
    model = ANCHORS / f"{name}.onnx"
    args = OPTION_CASES[case]
    # No anchor model has pattern 1's scale chain, so both graphsurgeon versions agree here.
    expected = polygraphy_hints(model, args, tmp_path / "polygraphy.json")
    ours = shardcheck_hints(model, args, tmp_path / "ours.json")
    assert sorted_io(ours) == sorted_io(expected)


def test_pattern1_fixture_is_really_matched_by_the_recorded_oracle() -> None:
    recorded = read_json(RECORDED / "sdpa_scaled_attention.pattern1.json")
    assert [layer["q"] for layer in recorded["attention_layers"]] == ["q"]
    assert sorted(t["name"] for t in recorded["inputs"]) == ["k", "q", "v"]


@pytest.mark.parametrize("case", ["defaults", "fused_shuffles", "collectives", "empty_lists"])
@pytest.mark.parametrize("name", ["attention_head", "multi_attention", "sdpa_scaled_attention"])
def test_polygraphy_loads_our_file(name: str, case: str, tmp_path: Path) -> None:
    ours = tmp_path / "ours.json"
    shardcheck_hints(FIXTURES / f"{name}.onnx", OPTION_CASES[case], ours)
    loaded = multi_device.ShardHints.load(str(ours))
    document = read_json(ours)
    assert [layer.q for layer in loaded.attention_layers] == [
        layer["q"] for layer in document["attention_layers"]
    ]
    assert (
        loaded.dist_collectives.reduce_scatter_reduce_op
        == document["dist_collectives"]["reduce_op"]
    )
    assert [t.name for t in loaded.inputs] == [t["name"] for t in document["inputs"]]


@pytest.mark.parametrize("name", ["attention_head", "multi_attention", "attention_output_chain"])
def test_polygraphy_multi_device_shard_accepts_our_file(name: str, tmp_path: Path) -> None:
    import onnx

    ours = tmp_path / "ours.json"
    shardcheck_hints(FIXTURES / f"{name}.onnx", [], ours)
    out = tmp_path / "md.onnx"
    code = polygraphy_tools.main(
        ["multi-device", "shard", str(FIXTURES / f"{name}.onnx"), "-s", str(ours), "-o", str(out)]
    )
    assert code in (0, None)
    sharded = onnx.load(str(out))
    collectives = [n for n in sharded.graph.node if n.op_type == "DistCollective"]
    document = read_json(ours)
    # One reduce-scatter per input, K and V gathered per layer, one all-gather per output.
    expected = (
        len(document["inputs"]) + 2 * len(document["attention_layers"]) + len(document["outputs"])
    )
    assert len(collectives) == expected


def test_old_format_resaves_in_new_format_with_same_content(tmp_path: Path) -> None:
    old = {
        "parallelism": "CP",
        "attention_layers": [
            {
                "q": "q",
                "gather_kv": True,
                "gather_q": False,
                "polygraphy_class": "AttentionLayerHint",
            }
        ],
        "group_size": 2,
        "root": 0,
        "groups": [0, 1],
        "reduce_scatter_reduce_op": "sum",
        "inputs": [
            {"name": "input", "seq_len_idx": 1, "rank": 3, "polygraphy_class": "ShardTensor"}
        ],
        "outputs": [
            {"name": "output", "seq_len_idx": 1, "rank": 3, "polygraphy_class": "ShardTensor"}
        ],
        "k_seq_len_idx": 2,
        "v_seq_len_idx": 1,
        "kv_rank": 3,
        "polygraphy_class": "ShardHints",
    }
    source = tmp_path / "old.json"
    source.write_text(json.dumps(old))
    target = tmp_path / "new.json"
    assert run_cli("fmt", source, "-o", target).exit_code == 0
    new = read_json(target)
    assert new["dist_collectives"] == {
        "group_size": 2,
        "root": 0,
        "nb_rank": 1,
        "reduce_op": "sum",
        "groups": [0, 1],
        "polygraphy_class": "DistCollective",
    }
    assert new["attention_layers"][0]["replace"] is None
    for key in ("inputs", "outputs", "k_seq_len_idx", "v_seq_len_idx", "kv_rank", "parallelism"):
        assert new[key] == old[key]
    loaded = multi_device.ShardHints.load(str(target))
    assert loaded.dist_collectives.reduce_scatter_reduce_op == "sum"
    assert run_cli("diff", source, target).exit_code == 0
