"""``shardcheck shard``: the multi-device model, compared with Polygraphy 0.53.6 by structure."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import ANCHORS, FIXTURES, GOLDEN, run_cli
from onnx import TensorProto, helper, numpy_helper

from shardcheck import load_index, read_hints
from shardcheck.errors import InputError, OutputError
from shardcheck.graph.tensors import external_locations
from shardcheck.hints.model import (
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
    ShardTensor,
)
from shardcheck.runtime.sessions import run_model
from shardcheck.sharding.rewrite import shard_model
from shardcheck.sharding.save import save_sharded_model

PARITY_FIXTURES = [
    "attention",
    "attention_head",
    "multi_attention",
    "attention_output_chain",
    "sdpa_scaled_attention",
    "attention_same_qkv",
]
REAL = FIXTURES / "real"
ANCHOR_MODELS = ["attention", "attention_head", "attention_same_qkv", "multi_attention"]
OTHER_COLLECTIVES = DistCollective(group_size=2, root=0, nb_rank=2, groups=(0, 1), reduce_op="sum")


# --------------------------------------------------------------------------- structure


def structure(model: onnx.ModelProto, original: set[str]) -> Counter[tuple[Any, ...]]:
    """The model with every tensor the shard created written as the chain that made it, e.g.
    ``DistCollective[...](Transpose[1, 0, 2](q))``: which tensor each collective consumes, its
    attributes (in order, with types), which tensor each original node and each graph output
    reads. Generated names do not appear."""
    producers = {name: node for node in model.graph.node for name in node.output}

    def describe(tensor: str) -> str:
        if not tensor or tensor in original:
            return tensor
        node = producers[tensor]
        attributes = [
            (a.name, a.type, _plain(helper.get_attribute_value(a))) for a in node.attribute
        ]
        return f"{node.op_type}{attributes}({describe(node.input[0])})"

    items: Counter[tuple[Any, ...]] = Counter()
    for node in model.graph.node:
        if any(name in original for name in node.output):
            items[("node", node.op_type, tuple(node.output), tuple(map(describe, node.input)))] += 1
        elif node.op_type == "DistCollective":
            items[("collective", describe(node.output[0]))] += 1
    for output in model.graph.output:
        items[("output", describe(output.name))] += 1
    return items


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return tuple(value)
    return value


def original_tensors(path: Path) -> set[str]:
    index = load_index(path)
    return set(index.all_tensor_names())


def polygraphy_shard(model: Path, hints: Path, out: Path) -> onnx.ModelProto:
    tools = pytest.importorskip("polygraphy.tools")
    code = tools.main(["multi-device", "shard", str(model), "-s", str(hints), "-o", str(out)])
    assert code in (0, None)
    return onnx.load(str(out), load_external_data=False)


def ours(model: Path, hints: Path) -> onnx.ModelProto:
    return shard_model(load_index(model), read_hints(hints), hints_source=str(hints)).model


def write_hints(path: Path, hints: Any) -> Path:
    from shardcheck.hints.codec import dumps

    path.write_text(dumps(hints))
    return path


def assert_same_structure(model: Path, hints: Path, tmp_path: Path) -> None:
    expected = polygraphy_shard(model, hints, tmp_path / "polygraphy.onnx")
    names = original_tensors(model)
    assert structure(ours(model, hints), names) == structure(expected, names)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", PARITY_FIXTURES)
def test_same_structure_as_polygraphy_on_fixtures(name: str, tmp_path: Path) -> None:
    assert_same_structure(FIXTURES / f"{name}.onnx", GOLDEN / f"{name}.json", tmp_path)


@pytest.mark.parametrize("name", ["attention", "attention_head", "multi_attention"])
def test_same_structure_as_polygraphy_with_gather_q_and_other_collectives(
    name: str, tmp_path: Path
) -> None:
    golden = read_hints(GOLDEN / f"{name}.json")
    layers = tuple(dataclasses.replace(layer, gather_q=True) for layer in golden.attention_layers)
    hints = golden.with_changes(attention_layers=layers, dist_collectives=OTHER_COLLECTIVES)
    path = write_hints(tmp_path / "hints.json", hints)
    assert_same_structure(FIXTURES / f"{name}.onnx", path, tmp_path)


@pytest.mark.skipif(not ANCHORS.is_dir(), reason="../shared/anchor-models is not present")
@pytest.mark.parametrize("name", ANCHOR_MODELS)
def test_same_structure_as_polygraphy_on_anchor_models(name: str, tmp_path: Path) -> None:
    tools = pytest.importorskip("polygraphy.tools")
    model = ANCHORS / f"{name}.onnx"
    hints = tmp_path / "hints.json"
    assert tools.main(["template", "shard-hints", str(model), "-o", str(hints)]) in (0, None)
    assert_same_structure(model, hints, tmp_path)


def test_collective_attributes_are_polygraphys() -> None:
    hints = read_hints(GOLDEN / "attention_head.json").with_changes(
        dist_collectives=OTHER_COLLECTIVES
    )
    model = shard_model(load_index(FIXTURES / "attention_head.onnx"), hints).model
    collectives = [node for node in model.graph.node if node.op_type == "DistCollective"]
    attributes = [
        [(a.name, _plain(helper.get_attribute_value(a))) for a in node.attribute]
        for node in collectives
    ]
    common = [("group_size", 2), ("root", 0), ("nb_rank", 2)]
    scatter = [*common, ("reduce_op", "sum"), ("collective_operation", "reduce_scatter")]
    gather = [*common, ("reduce_op", "none"), ("collective_operation", "all_gather")]
    groups = ("groups", (0, 1))
    assert attributes == [[*scatter, groups]] + [[*gather, groups]] * 3
    assert all(node.domain == "" for node in collectives)
    default = shard_model(
        load_index(FIXTURES / "attention_head.onnx"), read_hints(GOLDEN / "attention_head.json")
    ).model
    collective = next(node for node in default.graph.node if node.op_type == "DistCollective")
    empty_groups = collective.attribute[-1]
    assert (empty_groups.name, empty_groups.type, list(empty_groups.ints)) == (
        "groups",
        onnx.AttributeProto.INTS,
        [],
    )


# --------------------------------------------------------------------------- our own rules


def test_nodes_are_topologically_sorted_and_outputs_keep_their_declaration() -> None:
    index = load_index(FIXTURES / "multi_attention.onnx")
    sharded = shard_model(index, read_hints(GOLDEN / "multi_attention.json"))
    graph = sharded.model.graph
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        assert all(name in available for name in node.input if name), node.name
        available.update(node.output)
    assert sharded.outputs == {"out1": "out1/all_gather", "out2": "out2"}
    gathered = graph.output[0]
    assert gathered.name == "out1/all_gather"
    assert gathered.type == index.output_infos["out1"].type


def test_layers_that_polygraphy_misses_are_gathered() -> None:
    # GPT-2's attention has a mask Add and an IsNaN/Where guard: neither Polygraphy pattern.
    index = load_index(REAL / "ts_gpt2_tiny.onnx")
    hints = read_hints(GOLDEN / "attention_head.json").with_changes(
        attention_layers=tuple(
            AttentionLayerHint(q=f"/model/h.{i}/attn/Mul_output_0", gather_kv=True, gather_q=False)
            for i in range(2)
        ),
        inputs=(ShardTensor("/model/Add_output_0", 1, 3),),
        outputs=(ShardTensor("last_hidden_state", 1, 3),),
        k_seq_len_idx=3,
        v_seq_len_idx=2,
        kv_rank=4,
    )
    sharded = shard_model(index, hints)
    gathered = {t.source for t in sharded.tails.values() if t.operation == "all_gather"}
    assert gathered == {
        "/model/h.0/attn/Mul_1_output_0",
        "/model/h.0/attn/Transpose_output_0",
        "/model/h.1/attn/Mul_1_output_0",
        "/model/h.1/attn/Transpose_output_0",
        "last_hidden_state",
    }


def test_a_shared_k_is_gathered_once(tmp_path: Path) -> None:
    path = _save(tmp_path, _two_layers(q=("q1", "q2"), k=("k", "k")))
    hints = _hints_for(("q1", "q2"), inputs=())
    sharded = shard_model(load_index(path), hints)
    # Polygraphy would gather k twice: the second layer reads the first gather by then.
    assert sorted(t.source for t in sharded.tails.values()) == ["k", "o1", "o2", "v1", "v2"]


def test_two_layers_reading_one_q_are_both_gathered_as_polygraphy_does(tmp_path: Path) -> None:
    path = _save(tmp_path, _two_layers(q=("q", "q"), k=("k1", "k2")))
    hints = write_hints(tmp_path / "hints.json", _hints_for(("q",), inputs=(ShardTensor("q", 0),)))
    sharded = shard_model(load_index(path), read_hints(hints))
    gathered = sorted(t.source for t in sharded.tails.values() if t.operation == "all_gather")
    assert gathered == ["k1", "k2", "o1", "o2", "v1", "v2"]
    assert_same_structure(path, hints, tmp_path)


def _hints_for(qs: tuple[str, ...], inputs: tuple[ShardTensor, ...]) -> ShardHints:
    return ShardHints(
        attention_layers=tuple(AttentionLayerHint(q=q, gather_kv=True, gather_q=False) for q in qs),
        inputs=inputs,
        outputs=(ShardTensor("o1", 0), ShardTensor("o2", 0)),
    )


def _two_layers(q: tuple[str, str], k: tuple[str, str]) -> onnx.ModelProto:
    nodes = []
    for i in (0, 1):
        nodes += [
            helper.make_node("MatMul", [q[i], k[i]], [f"s{i + 1}"], name=f"mm{i + 1}a"),
            helper.make_node("Softmax", [f"s{i + 1}"], [f"p{i + 1}"], name=f"sm{i + 1}"),
            helper.make_node(
                "MatMul", [f"p{i + 1}", f"v{i + 1}"], [f"o{i + 1}"], name=f"mm{i + 1}b"
            ),
        ]
    seq_first = ["s", 4]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, seq_first) for n in sorted(set(q))
    ]
    inputs += [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, "s"]) for n in sorted(set(k))
    ]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, seq_first) for n in ("v1", "v2")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, seq_first) for n in ("o1", "o2")]
    graph = helper.make_graph(nodes, "two_layers", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _save(directory: Path, model: onnx.ModelProto) -> Path:
    path = directory / f"{model.graph.name}.onnx"
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"inputs": (ShardTensor("nope", 0),)},
            "hints.json: inputs[0]: tensor 'nope' is not in the model",
        ),
        (
            {"attention_layers": (AttentionLayerHint("input", True, False),)},
            "hints.json: attention_layers[0]: q 'input' is not the Q of any attention layer",
        ),
        (
            {
                "attention_layers": (
                    AttentionLayerHint(
                        "input", False, False, replace=FusedAttention(is_causal=True)
                    ),
                )
            },
            "hints.json: attention_layers[0] (q 'input'): q 'input' is not the Q of any "
            "attention layer",
        ),
        ({"parallelism": "TP"}, "hints.json: parallelism 'TP': shard writes context"),
        (
            {"inputs": (ShardTensor("input", 3),)},
            "hints.json: inputs[0]: seq_len_idx 3 is out of range for 'input' of rank 3",
        ),
        # A hinted rank the tensor does not have would make Transposes of the wrong rank.
        (
            {"inputs": (ShardTensor("input", 1, 4),)},
            "hints.json: inputs[0]: rank 4 is given, but 'input' has rank 3",
        ),
        (
            {"kv_rank": 4},
            "hints.json: attention_layers[0] K: kv_rank 4 is given, but 'k_T' has rank 3",
        ),
        (
            {"k_seq_len_idx": 4},
            "hints.json: attention_layers[0] K: k_seq_len_idx 4 is out of range for 'k_T' of "
            "rank 3",
        ),
    ],
)
def test_unusable_hints_are_one_line_errors(change: dict[str, Any], message: str) -> None:
    hints = read_hints(GOLDEN / "attention_head.json").with_changes(**change)
    index = load_index(FIXTURES / "attention_head.onnx")
    with pytest.raises(InputError) as error:
        shard_model(index, hints, hints_source="hints.json")
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_a_transpose_needs_a_rank() -> None:
    # attention_same_qkv declares no shapes at all.
    hints = read_hints(GOLDEN / "attention_same_qkv.json").with_changes(
        inputs=(ShardTensor("q", 1),)
    )
    with pytest.raises(InputError) as error:
        shard_model(load_index(FIXTURES / "attention_same_qkv.onnx"), hints, hints_source="h")
    assert str(error.value) == (
        "h: inputs[0]: seq_len_idx 1 needs the rank of 'q', but the model declares no shape "
        "for it and the hint gives no rank: write its number of axes as the hint's rank"
    )


# --------------------------------------------------------------------------- writing


def _external_model(directory: Path) -> Path:
    weight = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["q"], name="proj"),
        helper.make_node("Transpose", ["q"], ["k"], name="t", perm=[1, 0]),
        helper.make_node("MatMul", ["q", "k"], ["s"], name="mm1"),
        helper.make_node("Softmax", ["s"], ["p"], name="sm"),
        helper.make_node("MatMul", ["p", "q"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = directory / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    return path


def _external_hints(path: Path) -> Path:
    # The model's K is [4, seq] (the Transpose of q) and V, q itself, [seq, 4].
    hints = read_hints(GOLDEN / "attention_head.json").with_changes(
        inputs=(ShardTensor("x", 0),),
        outputs=(ShardTensor("y", 0),),
        k_seq_len_idx=1,
        v_seq_len_idx=0,
        kv_rank=2,
    )
    return write_hints(path, hints)


def test_external_weights_are_placed_next_to_the_output(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    model = _external_model(tmp_path / "src")
    hints = _external_hints(tmp_path / "hints.json")
    result = run_cli("shard", model, hints, "-o", tmp_path / "out" / "md.onnx")
    assert result.exit_code == 0, result.stderr
    placed = tmp_path / "out" / "weights.bin"
    assert placed.read_bytes() == (tmp_path / "src" / "weights.bin").read_bytes()
    written = onnx.load(str(tmp_path / "out" / "md.onnx"))
    assert numpy_helper.to_array(written.graph.initializer[0])[3, 3] == 15.0


def test_external_weights_next_to_the_source_are_shared(tmp_path: Path) -> None:
    model = _external_model(tmp_path)
    sharded = shard_model(load_index(model), read_hints(_external_hints(tmp_path / "h.json")))
    assert save_sharded_model(sharded.model, source=model, output=tmp_path / "md.onnx") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "h.json",
        "md.onnx",
        "model.onnx",
        "weights.bin",
    ]


def test_weight_files_named_only_inside_subgraphs_are_placed_too(tmp_path: Path) -> None:
    """An If's branches hold their own initializers; one of them is the only tensor in its
    file. The sharded model would not load without that file next to it."""
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    branches = []
    for branch, value in (("then", 1.0), ("else", 2.0)):
        constant = numpy_helper.from_array(np.full(4, value, dtype=np.float32), f"{branch}_c")
        branches.append(
            helper.make_graph(
                [helper.make_node("Identity", [constant.name], [f"{branch}_out"])],
                branch,
                [],
                [helper.make_tensor_value_info(f"{branch}_out", TensorProto.FLOAT, [4])],
                [constant],
            )
        )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branches[0], else_branch=branches[1])],
        "branches",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for attribute in model.graph.node[0].attribute:  # the model's own copies of the branches
        tensor = attribute.g.initializer[0]
        location = f"{attribute.g.name}.bin"
        (tmp_path / "src" / location).write_bytes(tensor.raw_data)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=location)
    source = tmp_path / "src" / "model.onnx"
    source.write_bytes(model.SerializeToString())

    assert external_locations(model) == {"then.bin", "else.bin"}
    copied = save_sharded_model(model, source=source, output=tmp_path / "out" / "md.onnx")
    assert sorted(path.name for path in copied) == ["else.bin", "then.bin"]
    session = ort.InferenceSession(str(tmp_path / "out" / "md.onnx"))
    assert session.run(None, {"cond": np.array(False)})[0].tolist() == [2.0] * 4


def test_a_different_weight_file_at_the_output_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    model = _external_model(tmp_path / "src")
    (tmp_path / "out" / "weights.bin").write_bytes(b"other model")
    sharded = shard_model(load_index(model), read_hints(_external_hints(tmp_path / "h.json")))
    with pytest.raises(OutputError, match="a different file is already there"):
        save_sharded_model(sharded.model, source=model, output=tmp_path / "out" / "md.onnx")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == b"other model"
    assert not (tmp_path / "out" / "md.onnx").exists()


def test_without_collectives_the_model_still_runs(tmp_path: Path) -> None:
    # A sharded model minus nothing: hints without inputs, outputs or layers change nothing.
    hints = read_hints(GOLDEN / "no_attention.json")
    sharded = shard_model(load_index(FIXTURES / "no_attention.onnx"), hints)
    feeds = {"x": np.ones((1, 3, 16), dtype=np.float32)}
    assert run_model(sharded.model, feeds)["y"].shape == (1, 3, 16)


# --------------------------------------------------------------------------- command line


def test_cli_shard_writes_the_model(tmp_path: Path) -> None:
    out = tmp_path / "md.onnx"
    result = run_cli(
        "shard", FIXTURES / "attention_head.onnx", GOLDEN / "attention_head.json", "-o", out
    )
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    ops = [node.op_type for node in onnx.load(str(out)).graph.node]
    assert ops.count("DistCollective") == 4


def test_cli_shard_bad_hints_exit_2_with_one_line(tmp_path: Path) -> None:
    hints = read_hints(GOLDEN / "attention_head.json").with_changes(
        inputs=(ShardTensor("nope", 0),)
    )
    path = write_hints(tmp_path / "hints.json", hints)
    result = run_cli("shard", FIXTURES / "attention_head.onnx", path, "-o", tmp_path / "md.onnx")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert "inputs[0]: tensor 'nope' is not in the model" in result.stderr
    assert not (tmp_path / "md.onnx").exists()


def test_cli_shard_refuses_to_overwrite_its_input(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes((FIXTURES / "attention_head.onnx").read_bytes())
    result = run_cli("shard", model, GOLDEN / "attention_head.json", "-o", model)
    assert result.exit_code == 2
    assert "is the input model" in result.stderr


def test_a_weight_copy_writes_through_no_planted_temporary_name(tmp_path: Path) -> None:
    # The copy's temporary file has a name of its own, created exclusively: a link planted
    # under the old fixed name ".weights.bin.tmp" is not written through, and a file under
    # it is not removed.
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    model = _external_model(tmp_path / "src")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    (tmp_path / "out" / ".weights.bin.tmp").symlink_to(outside)
    sharded = shard_model(load_index(model), read_hints(_external_hints(tmp_path / "h.json")))
    save_sharded_model(sharded.model, source=model, output=tmp_path / "out" / "md.onnx")
    assert outside.read_bytes() == b"not yours"
    assert (tmp_path / "out" / ".weights.bin.tmp").is_symlink()
    copied = tmp_path / "out" / "weights.bin"
    assert copied.read_bytes() == (tmp_path / "src" / "weights.bin").read_bytes()
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert left == [".weights.bin.tmp", "md.onnx", "weights.bin"]
