"""The extension that inlines model-local functions (sharding/inlined.py, issue 27).

The real export ts_attention_in_functions.onnx writes each attention block as a call of the
function SDPABlock: no hint can name a tensor of its body, so the Polygraphy-format hints shard
nothing. gen offers the extension that names the function; every command inlines it first,
and the multi-device model ``shard`` writes from it runs every projection on slices
(test_lengths_real.py counts it and runs verify at 2 and 4 ranks, batch 1 and 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, one_model_manifest, run_cli

from shardcheck.hints.files import read_hints

MODEL = FIXTURES / "real" / "ts_attention_in_functions.onnx"
TRUTH = json.loads((FIXTURES / "real" / "TRUTH.json").read_text())["ts_attention_in_functions"]


def gen(tmp_path: Path, *options: str) -> tuple[Path, Path]:
    hints = tmp_path / "h.json"
    result = run_cli("gen", MODEL, "-o", hints, *options)
    assert result.exit_code == 0, result.stderr
    return hints, tmp_path / "h.shardcheck.json"


def test_gen_writes_the_extension_naming_the_function(tmp_path: Path) -> None:
    hints, extension = gen(tmp_path)
    document = json.loads(extension.read_text())
    # The model's one local function, as the file declares it.
    [function] = onnx.load(MODEL).functions
    assert document["inlined_functions"] == [{"domain": function.domain, "name": function.name}]
    assert (function.domain, function.name) == ("__main__", "SDPABlock")
    # Its hints name the inlined graph's layers: the Q tensors TRUTH.json records for it.
    queries = [layer["q"] for layer in document["hints"]["attention_layers"]]
    assert queries == [node["q_tensor"] for node in TRUTH["attention_nodes"]]
    assert [t["name"] for t in document["hints"]["inputs"]] == ["input_ids"]
    # The hints file is the one --no-extension writes: no layer, nothing to shard.
    alone = tmp_path / "alone"
    alone.mkdir()
    plain, _ = gen(alone, "--no-extension")
    assert hints.read_bytes() == plain.read_bytes()
    assert json.loads(hints.read_text())["attention_layers"] == []


def test_gen_says_the_extension_shards_what_the_hints_cannot(tmp_path: Path) -> None:
    result = run_cli("gen", MODEL, "-o", tmp_path / "h.json")
    assert "[SC129]" in result.stderr
    assert "'shardcheck shard' inlines the functions first" in result.stderr
    assert (
        "Polygraphy-compatible hints: 0.0% of the projection and MLP FLOPs on slices; "
        "'shardcheck shard' with the extension"
    ) in result.stderr
    assert result.stderr.rstrip().endswith(": 100.0%")


def test_gen_is_deterministic(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, first = gen(tmp_path / "a")
    _, second = gen(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()


def test_the_multi_device_model_has_no_function_left(tmp_path: Path) -> None:
    _, extension = gen(tmp_path)
    out = tmp_path / "md.onnx"
    assert run_cli("shard", MODEL, extension, "-o", out).exit_code == 0
    model = onnx.load(out)
    assert not model.functions
    assert not [node for node in model.graph.node if node.domain == "__main__"]
    # TensorRT's DistCollective nodes, each with its operation (Polygraphy's format).
    collectives = sorted(
        next(a.s.decode() for a in node.attribute if a.name == "collective_operation")
        for node in model.graph.node
        if node.op_type == "DistCollective"
    )
    assert collectives == ["all_gather"] * 5 + ["reduce_scatter"]


def test_explain_counts_both_plans(tmp_path: Path) -> None:
    result = run_cli("explain", MODEL, "--format", "json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["plans"]["written"] == "extension"
    assert document["plans"]["hints"]["projections_on_slices"] == 0.0
    assert document["plans"]["extension"]["projections_on_slices"] == 1.0
    assert document["plan"]["flops"]["by_class"]["projections"]["whole"] == 0


def test_an_extension_naming_a_function_the_model_lacks_is_refused(tmp_path: Path) -> None:
    _, extension = gen(tmp_path)
    document = json.loads(extension.read_text())
    document["inlined_functions"] = [{"domain": "__main__", "name": "Other"}]
    extension.write_text(json.dumps(document))
    for command in (
        ["shard", MODEL, extension, "-o", tmp_path / "md.onnx"],
        ["explain", MODEL, extension],
    ):
        result = run_cli(*command)
        assert result.exit_code == 2, result.stdout
        [line] = result.stderr.splitlines()
        assert str(extension) in line and "__main__.Other is not a model-local function" in line
    assert not (tmp_path / "md.onnx").exists()


@pytest.mark.parametrize(
    "value, wrong",
    [
        ("SDPABlock", "expected a list of"),
        (["SDPABlock"], 'expected a {"domain": ..., "name": ...} object'),
        ([{"domain": "__main__"}], 'expected a {"domain": ..., "name": ...} object'),
        ([{"domain": "__main__", "name": ""}], "object with a name"),
        ([{"domain": "a", "name": "B"}, {"domain": "a", "name": "B"}], "twice"),
    ],
)
def test_a_malformed_inlined_functions_is_refused(
    value: object, wrong: str, tmp_path: Path
) -> None:
    _, extension = gen(tmp_path)
    document = json.loads(extension.read_text())
    document["inlined_functions"] = value
    extension.write_text(json.dumps(document))
    result = run_cli("explain", MODEL, extension)
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert str(extension) in line and "inlined_functions" in line and wrong in line


def test_diff_names_the_inlined_functions(tmp_path: Path) -> None:
    _, extension = gen(tmp_path)
    document = json.loads(extension.read_text())
    del document["inlined_functions"]
    other = tmp_path / "other.shardcheck.json"
    other.write_text(json.dumps(document))
    result = run_cli("diff", extension, other)
    assert result.exit_code == 1
    assert "inlined_functions" in result.stdout and "__main__:SDPABlock" in result.stdout
    assert read_hints(other).lengths is not None
    document["inlined_functions"] = [
        {"domain": "__main__", "name": "SDPABlock"},
        {"domain": "pkg", "name": "Mlp"},
    ]
    other.write_text(json.dumps(document))
    result = run_cli("diff", extension, other)
    assert result.stdout.splitlines()[0] == 'inlined_functions[function=pkg:Mlp]: added "inlined"'


def test_check_gates_the_extension(tmp_path: Path) -> None:
    manifest = one_model_manifest(tmp_path, MODEL, "")
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    golden = tmp_path / "golden"
    assert read_hints(golden / "model.shardcheck.json").lengths.inlined == (
        ("__main__", "SDPABlock"),
    )
    # The plan recorded is the extension's: every FLOP of the projections on slices.
    assert json.loads((golden / "model.plan").read_text())["flops_on_slices"] > 0.99
    again = run_cli("check", "--manifest", manifest)
    assert again.exit_code == 0, again.stdout
    # The golden extension is the plan verify proves; the golden hints, of no layer, fail it.
    model = tmp_path / MODEL.name
    proved = run_cli("verify", model, golden / "model.shardcheck.json", "--ranks", "2", "-q")
    assert proved.exit_code == 0, proved.stdout
    refused = run_cli("verify", model, golden / "model.json", "--ranks", "2", "-q")
    assert refused.exit_code == 1 and "SC129" in refused.stdout


def test_functions_holding_the_mlps_are_inlined_too(tmp_path: Path) -> None:
    # ts_mlp_in_functions.onnx: attention in the main graph, each block's MLP a call of the
    # function nn.Sequential. No shape is inferred past a call, so the hints' plan is not
    # counted; the extension inlines the function and runs everything on slices.
    model = FIXTURES / "real" / "ts_mlp_in_functions.onnx"
    result = run_cli("gen", model, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    assert "[SC129]" not in result.stderr  # no attention in a function
    assert (
        "Polygraphy-compatible hints: not counted (shapes unknown past a function call); "
        "'shardcheck shard' with the extension"
    ) in result.stderr
    [function] = onnx.load(model).functions
    document = json.loads((tmp_path / "h.shardcheck.json").read_text())
    assert document["inlined_functions"] == [{"domain": function.domain, "name": function.name}]
    assert function.name == "Sequential"
    explained = run_cli("explain", model, "--format", "json")
    plans = json.loads(explained.stdout)["plans"]
    assert plans["hints"] is None and plans["extension"]["projections_on_slices"] == 1.0


def test_a_model_whose_functions_cannot_be_inlined(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # onnx's inliner refusing the model (as it may a malformed function): gen writes the
    # hints alone, and shard refuses the extension in one line naming the model.
    hints, extension = gen(tmp_path)
    import onnx.inliner

    def refuse(*_: object) -> None:
        raise RuntimeError("function body\nis malformed")

    monkeypatch.setattr(onnx.inliner, "inline_selected_functions", refuse)
    again = tmp_path / "again"
    again.mkdir()
    written = run_cli("gen", MODEL, "-o", again / "h.json")
    assert written.exit_code == 0, written.stderr
    assert (again / "h.json").read_bytes() == hints.read_bytes()
    assert not (again / "h.shardcheck.json").exists()
    refused = run_cli("shard", MODEL, extension, "-o", tmp_path / "md.onnx")
    assert refused.exit_code == 2
    [line] = refused.stderr.splitlines()
    assert (
        str(MODEL) in line and "its model-local functions cannot be inlined: function body" in line
    )
