"""Stages of one form share one onnxruntime session (stage_forms.py, ahead.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, GOLDEN, simulated_lengths
from onnx import TensorProto, helper, numpy_helper

from shardcheck import load_index, read_hints, verify
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.hints.model import DistCollective
from shardcheck.runtime.feeds import make_feeds
from shardcheck.runtime.sizes import resolve_dims
from shardcheck.sharding.rewrite import (
    ALL_GATHER,
    COLLECTIVE_OP,
    REDUCE_SCATTER,
    ShardedModel,
    collective_attributes,
    shard_model,
)
from shardcheck.simulation import ahead
from shardcheck.simulation.ahead import mapped_weight
from shardcheck.simulation.rank_values import RankFailure
from shardcheck.simulation.simulate import simulate
from shardcheck.simulation.simulator import RankSimulator
from shardcheck.simulation.stage_forms import stage_form

REAL = FIXTURES / "real"


def _weight(name: str, values: list[float], dtype: Any = np.float32) -> TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=dtype), name)


def _scale_stage(prefix: str, weight: str, alpha: float = 1.0) -> tuple[list[Any], list[list[str]]]:
    """x -> Mul by ``weight`` -> LeakyRelu(alpha): the tensors named after ``prefix``."""
    nodes = [
        helper.make_node("Mul", [f"{prefix}_in", weight], [f"{prefix}_mul"], name=f"{prefix}_m"),
        helper.make_node("LeakyRelu", [f"{prefix}_mul"], [f"{prefix}_out"], alpha=alpha),
    ]
    return nodes, [list(node.input) for node in nodes]


def _form(prefix: str, weight: str, weights: dict[str, TensorProto], alpha: float = 1.0) -> Any:
    nodes, reads = _scale_stage(prefix, weight, alpha)
    return stage_form(
        nodes, reads, [f"{prefix}_in"], [TensorProto.FLOAT], [f"{prefix}_out"], weights
    )


def test_stages_differing_in_names_and_weight_values_are_of_one_form() -> None:
    weights = {"w0": _weight("w0", [1.0, 2.0]), "w1": _weight("w1", [3.0, 4.0])}
    first, second = _form("a", "w0", weights), _form("b", "w1", weights)
    assert first is not None and second is not None
    assert first.key == second.key
    assert (first.lifted, second.lifted) == (("w0",), ("w1",))


@pytest.mark.parametrize(
    "change",
    ["attribute", "weight shape", "weight type", "input type", "output"],
)
def test_what_a_session_computes_tells_forms_apart(change: str) -> None:
    weights = {"w0": _weight("w0", [1.0, 2.0]), "w1": _weight("w1", [3.0, 4.0])}
    if change == "weight shape":
        weights["w1"] = _weight("w1", [3.0, 4.0, 5.0])
    if change == "weight type":
        weights["w1"] = _weight("w1", [3.0, 4.0], np.float16)
    first = _form("a", "w0", weights)
    nodes, reads = _scale_stage("b", "w1", 0.5 if change == "attribute" else 1.0)
    input_type = TensorProto.FLOAT16 if change == "input type" else TensorProto.FLOAT
    output = "b_mul" if change == "output" else "b_out"
    second = stage_form(nodes, reads, ["b_in"], [input_type], [output], weights)
    assert first is not None and second is not None
    assert first.key != second.key


def test_which_outputs_a_node_makes_tells_forms_apart() -> None:
    """Dropout's output or its mask, read the same way after: two computations."""

    def dropout_form(prefix: str, made: list[str]) -> Any:
        node = helper.make_node("Dropout", [f"{prefix}_in"], made)
        after = helper.make_node("Relu", [next(name for name in made if name)], [f"{prefix}_out"])
        return stage_form(
            [node, after],
            [[f"{prefix}_in"], list(after.input)],
            [f"{prefix}_in"],
            [TensorProto.FLOAT],
            [f"{prefix}_out"],
            {},
        )

    output, mask = dropout_form("a", ["a_y", ""]), dropout_form("b", ["", "b_mask"])
    assert output is not None and mask is not None
    assert output.key != mask.key
    again = dropout_form("c", ["c_y", ""])
    assert again is not None and again.key == output.key


def test_external_weights_are_lifted_as_the_others() -> None:
    weights = {"w0": _weight("w0", [1.0, 2.0]), "w1": _weight("w1", [3.0, 4.0])}
    for tensor in weights.values():
        tensor.data_location = TensorProto.EXTERNAL
    first, second = _form("a", "w0", weights), _form("b", "w1", weights)
    assert first is not None and second is not None
    assert (first.lifted, second.lifted) == (("w0",), ("w1",))
    assert first.key == second.key


def test_weights_numpy_has_no_dtype_of_stay_initializers_known_by_name() -> None:
    weights = {
        name: helper.make_tensor(name, TensorProto.BFLOAT16, [2], [1.0, 2.0])
        for name in ("w0", "w1")
    }
    first, second = _form("a", "w0", weights), _form("b", "w1", weights)
    assert first is not None and second is not None
    assert first.lifted == second.lifted == ()
    assert first.key != second.key
    again = _form("c", "w0", weights)
    assert again is not None and again.key == first.key  # the same weight


def test_a_stage_with_subgraphs_has_no_form() -> None:
    branch = helper.make_graph(
        [helper.make_node("Identity", ["a_in"], ["inner"])],
        "branch",
        [],
        [helper.make_tensor_value_info("inner", TensorProto.FLOAT, None)],
    )
    node = helper.make_node("If", ["cond"], ["a_out"], then_branch=branch, else_branch=branch)
    form = stage_form(
        [node],
        [["cond", "a_in"]],
        ["cond", "a_in"],
        [TensorProto.BOOL, TensorProto.FLOAT],
        ["a_out"],
        {},
    )
    assert form is None


# --------------------------------------------------------------------------- the simulator


def _count_sessions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The sessions the simulator makes (real ones), as they are made."""
    make = ahead.make_session
    made: list[Any] = []

    def counted(*args: Any) -> Any:
        session = make(*args)
        made.append(session)
        return session

    monkeypatch.setattr(ahead, "make_session", counted)
    return made


@pytest.mark.parametrize(
    ("name", "lifts"), [("ts_transformer_encoder", False), ("dynamo_einsum_causal", True)]
)
def test_stages_of_one_form_run_on_one_session_with_their_own_weights(
    name: str, lifts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layers' stages share their leader's session; each rank's values are those of the
    simulation with one session per stage, bit for bit (the same kernels on the same data)."""
    path = REAL / f"{name}.onnx"
    hints = read_hints(GOLDEN / "real" / f"{name}.json")
    index = load_index(path)
    sharded = shard_model(index, hints)
    feeds = make_feeds(index, resolve_dims(index, hints, 8, {}), seed=0)

    made = _count_sessions(monkeypatch)
    shared = RankSimulator(sharded, index.model, 2)
    stages = [step for step in shared.steps if hasattr(step, "sessions")]
    members = [stage for stage in stages if stage.leader not in (None, stage)]
    assert members
    assert all(stage.ahead is stage.leader.ahead for stage in members)
    assert any(stage.lifted for stage in members) == lifts  # weights read, or none
    shared_values = shared.run(feeds)
    # One session per stage that leads a form or has none; the members made none.
    assert len(made) == len(stages) - len(members)
    assert all(not stage.sessions for stage in members)

    apart = RankSimulator(sharded, index.model, 2, share_forms=False).run(feeds)
    for rank in range(2):
        assert shared_values.per_rank[rank].keys() == apart.per_rank[rank].keys()
        for tensor, value in apart.per_rank[rank].items():
            assert np.array_equal(shared_values.per_rank[rank][tensor], value), tensor


def _two_reshapes(second_rows: int) -> tuple[ShardedModel, onnx.ModelProto]:
    """x -> Reshape to [2, -1] -> all_gather -> Reshape to [second_rows, -1]: two stages of
    one form (a Reshape by a weight of two int64s), the second fed twice the first's output."""
    gather = helper.make_node(COLLECTIVE_OP, ["first_out"], ["gathered"], name="gather")
    gather.attribute.extend(collective_attributes(DistCollective(), ALL_GATHER))
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "rows_first"], ["first_out"], name="first"),
            gather,
            helper.make_node("Reshape", ["gathered", "rows_second"], ["y"], name="second"),
        ],
        "two_reshapes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
        [
            _weight("rows_first", [2, -1], np.int64),
            _weight("rows_second", [second_rows, -1], np.int64),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return ShardedModel(model), model


def test_a_stage_runs_on_its_leaders_session_with_its_own_weights() -> None:
    sharded, model = _two_reshapes(second_rows=8)
    simulator = RankSimulator(sharded, model, 2)
    first, second = [step for step in simulator.steps if hasattr(step, "sessions")]
    assert second.leader is first and second.lifted == ("rows_second",)
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    values = simulator.run({"x": x})
    expected = np.concatenate([x.reshape(2, -1)] * 2).reshape(8, -1)
    for rank_values in values.per_rank:
        assert np.array_equal(rank_values["y"], expected)
    assert not second.sessions  # it ran on the leader's


def test_a_stage_its_shared_session_cannot_run_fails_on_its_own_node(tmp_path: Path) -> None:
    """48 values cannot take 5 rows: the shared session fails, the stage's own session runs
    it again and its error names the stage's own node, not the leader's."""
    sharded, model = _two_reshapes(second_rows=5)
    simulator = RankSimulator(sharded, model, 2)
    second = [step for step in simulator.steps if hasattr(step, "sessions")][1]
    assert second.leader is not None
    with pytest.raises(RankFailure) as failure:
        simulator.run({"x": np.zeros((4, 6), dtype=np.float32)})
    assert failure.value.node == "second"
    assert second.leader is None and second.sessions  # from now on, its own session


def test_a_simulation_on_shared_sessions_matches_the_single_device_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "dynamo_llama_tiny_gqa"
    index = load_index(REAL / f"{name}.onnx")
    hints = generate(index, GenOptions()).hints
    made = _count_sessions(monkeypatch)
    result = simulate(REAL / f"{name}.onnx", hints, ranks=2, seq_len=8)
    assert result.ok, result.summary()
    assert len(made) < result.stages  # the stage sessions (the single-device one is apart)


# --------------------------------------------------------------------------- constants


def test_each_stage_computes_the_constants_it_reads() -> None:
    """A Constant node is copied into every stage that reads it instead of being computed by
    the first stage and handed on: no stage hands on a constant, and the layers' stages,
    holding their own constants, are of one form."""
    name = "ts_einsum_causal"
    index = load_index(REAL / f"{name}.onnx")
    simulator = RankSimulator(
        shard_model(index, read_hints(GOLDEN / "real" / f"{name}.json")), index.model, 2
    )
    stages = [step for step in simulator.steps if hasattr(step, "sessions")]
    constants = {node.output[0] for node in simulator.nodes if node.op_type == "Constant"}
    assert constants
    for stage in stages:
        made_here = {name for node in stage.nodes for name in node.output}
        assert not constants.intersection(stage.inputs)
        assert not constants.intersection(stage.outputs)
        read = {name for names in stage.reads for name in names}
        assert constants & read <= made_here
    members = [stage for stage in stages if stage.leader not in (None, stage)]
    assert any(node.op_type == "Constant" for stage in members for node in stage.nodes)


def _constant_to_collective_and_output() -> onnx.ModelProto:
    """A Constant all-gathered and another that is a graph output: both stay computed once,
    by the stage of their level."""
    gather = helper.make_node(COLLECTIVE_OP, ["rows"], ["gathered"], name="gather")
    gather.attribute.extend(collective_attributes(DistCollective(), ALL_GATHER))
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["rows"], name="rows", value=_weight("v", [1.0, 2.0])),
            helper.make_node("Constant", [], ["kept"], name="kept", value=_weight("k", [3.0])),
            gather,
            helper.make_node("Add", ["gathered", "x"], ["y"], name="add"),
        ],
        "constants",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("kept", TensorProto.FLOAT, None),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_constants_a_collective_reads_or_the_graph_returns_are_handed_on() -> None:
    model = _constant_to_collective_and_output()
    simulator = RankSimulator(ShardedModel(model), model, 2)
    x = np.array([10.0, 20.0, 30.0, 40.0], dtype=np.float32)
    values = simulator.run({"x": x})
    for rank_values in values.per_rank:
        assert np.array_equal(rank_values["y"], x + np.array([1, 2, 1, 2], dtype=np.float32))
        assert np.array_equal(rank_values["kept"], np.array([3.0], dtype=np.float32))


# --------------------------------------------------------------------------- external weights


def test_external_weights_of_a_shared_session_are_mapped_from_their_file(tmp_path: Path) -> None:
    """A stage on its leader's session is fed its own weights; kept in an external file, they
    are mapped from it, not read into memory, and the values are those the file holds."""
    _, model = _two_reshapes(second_rows=8)
    path = tmp_path / "two_reshapes.onnx"
    onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    saved = onnx.load(path, load_external_data=False)  # onnx.checker knows no DistCollective
    assert all(t.data_location == TensorProto.EXTERNAL for t in saved.graph.initializer)
    simulator = RankSimulator(ShardedModel(saved), saved, 2, tmp_path)
    first, second = [step for step in simulator.steps if hasattr(step, "sessions")]
    assert second.leader is first and second.lifted == ("rows_second",)
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    values = simulator.run({"x": x})
    expected = np.concatenate([x.reshape(2, -1)] * 2).reshape(8, -1)
    assert all(np.array_equal(rank_values["y"], expected) for rank_values in values.per_rank)
    mapped = simulator.sessions.lifted_value("rows_second")
    assert not mapped.flags.owndata and not mapped.flags.writeable  # a view of the file
    assert mapped.tolist() == [8, -1]
    assert not second.sessions  # it ran on the leader's


def test_an_external_weight_whose_length_is_not_its_size_is_not_mapped(tmp_path: Path) -> None:
    """The session the stage shares is left for its own, which onnxruntime makes from the
    file as the model says (and which reports what is wrong with it)."""
    tensor = _weight("w", [1.0, 2.0])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", "4")):
        tensor.external_data.add(key=key, value=value)
    (tmp_path / "weights.bin").write_bytes(np.array([1.0, 2.0], dtype=np.float32).tobytes())
    with pytest.raises(ValueError, match="'w': its external data cannot be mapped"):
        mapped_weight(tensor, tmp_path)
    tensor.external_data[2].value = "8"
    assert mapped_weight(tensor, tmp_path).tolist() == [1.0, 2.0]


def test_verify_simulates_every_length_on_the_shared_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verify simulates at each of its lengths on the sessions made once: with shared
    sessions it makes fewer and reports exactly what it reports with one per stage."""
    name = "dynamo_llama_tiny_gqa"
    index = load_index(REAL / f"{name}.onnx")
    hints = generate(index, GenOptions()).hints

    def verified() -> tuple[int, list[Any], list[Any]]:
        made = _count_sessions(monkeypatch)
        report = verify(REAL / f"{name}.onnx", hints, ranks=2)
        findings = [(f.code, f.field, f.message) for f in report.findings]
        return len(made), findings, simulated_lengths(report)

    shared, shared_findings, lengths = verified()
    assert lengths == [(8, True), (16, True)]
    monkeypatch.setattr(ahead, "stage_form", lambda *args: None)  # no stage has a form
    apart, apart_findings, _ = verified()
    assert shared < apart
    assert shared_findings == apart_findings


# --------------------------------------------------------------------------- work on weights


def _weight_work_model() -> onnx.ModelProto:
    """x -> reduce-scatter -> MatMul by Transpose(w1) -> all-gather -> MatMul by Transpose(w2)
    -> y; beside them Transpose(w3), a graph output, and Neg(w4), all-gathered."""
    nodes = [
        helper.make_node(COLLECTIVE_OP, ["x"], ["x_rs"], name="scatter"),
        helper.make_node("Transpose", ["w1"], ["w1_t"], name="t1", perm=[1, 0]),
        helper.make_node("MatMul", ["x_rs", "w1_t"], ["h"], name="mm1"),
        helper.make_node(COLLECTIVE_OP, ["h"], ["h_ag"], name="gather"),
        helper.make_node("Transpose", ["w2"], ["w2_t"], name="t2", perm=[1, 0]),
        helper.make_node("MatMul", ["h_ag", "w2_t"], ["y"], name="mm2"),
        helper.make_node("Transpose", ["w3"], ["w3_t"], name="t3", perm=[1, 0]),
        helper.make_node("Neg", ["w4"], ["w4_neg"], name="neg4"),
        helper.make_node(COLLECTIVE_OP, ["w4_neg"], ["w4_ag"], name="gather4"),
    ]
    operations = {"scatter": REDUCE_SCATTER, "gather": ALL_GATHER, "gather4": ALL_GATHER}
    for node in nodes:
        if node.name in operations:
            node.attribute.extend(
                collective_attributes(DistCollective(reduce_op="max"), operations[node.name])
            )
    rng = np.random.default_rng(7)
    weights = [
        numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), name)
        for name in ("w1", "w2", "w3", "w4")
    ]
    graph = helper.make_graph(
        nodes,
        "weight_work",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
            for name in ("y", "w3_t", "w4_ag")
        ],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_work_on_weights_alone_runs_in_the_stage_that_reads_it() -> None:
    """Each Transpose of a weight runs in the stage of the MatMul that reads it, not in the
    first stage, which would hold every transposed weight to the end; one the graph returns
    or a collective reads stays where its inputs are."""
    model = _weight_work_model()
    simulator = RankSimulator(ShardedModel(model), model, 2)
    stage_of = {
        node.name: step.level
        for step in simulator.steps
        if hasattr(step, "sessions")
        for node in step.nodes
    }
    assert stage_of["t1"] == stage_of["mm1"] == 1
    assert stage_of["t2"] == stage_of["mm2"] == 2
    assert stage_of["t3"] == stage_of["neg4"] == 0
    handed_on = {
        name for step in simulator.steps if hasattr(step, "sessions") for name in step.outputs
    }
    assert not handed_on & {"w1_t", "w2_t"}
    x = np.random.default_rng(8).standard_normal((4, 3)).astype(np.float32)
    values = simulator.run({"x": x}).per_rank
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    h = np.concatenate([part @ weights["w1"].T for part in np.split(x, 2)])  # max of two copies
    for rank_values in values:
        np.testing.assert_allclose(rank_values["y"], h @ weights["w2"].T, rtol=1e-5)
        np.testing.assert_array_equal(rank_values["w3_t"], weights["w3"].T)
        np.testing.assert_array_equal(rank_values["w4_ag"], np.concatenate([-weights["w4"]] * 2))


def test_a_quantized_weight_is_dequantized_in_the_stage_that_reads_it() -> None:
    """x -> all-gather -> MatMul by DequantizeLinear(int8 weight, scale) -> y: the float weight
    is made in the stage of the MatMul, not ahead of the collective."""
    gather = helper.make_node(COLLECTIVE_OP, ["x"], ["x_ag"], name="gather")
    gather.attribute.extend(collective_attributes(DistCollective(), ALL_GATHER))
    quantized = np.arange(-4, 5, dtype=np.int8).reshape(3, 3)
    graph = helper.make_graph(
        [
            gather,
            helper.make_node("DequantizeLinear", ["wq", "scale"], ["w"], name="dequantize"),
            helper.make_node("MatMul", ["x_ag", "w"], ["y"], name="mm"),
        ],
        "dequantized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(quantized, "wq"),
            numpy_helper.from_array(np.array(0.5, dtype=np.float32), "scale"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    simulator = RankSimulator(ShardedModel(model), model, 2)
    stages = [step for step in simulator.steps if hasattr(step, "sessions")]
    assert [[node.name for node in stage.nodes] for stage in stages] == [["dequantize", "mm"]]
    x = np.random.default_rng(9).standard_normal((2, 3)).astype(np.float32)
    values = simulator.run({"x": x}).per_rank
    expected = np.concatenate([x, x]) @ (quantized.astype(np.float32) * 0.5)
    for rank_values in values:
        np.testing.assert_allclose(rank_values["y"], expected, rtol=1e-6)


def test_the_runs_make_a_forms_session_no_worker_took_and_share_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without workers (or when the runs outpace them) the first stage of a form to run makes
    the form's session, and the others run on it, instead of each making its own."""
    name = "dynamo_einsum_causal"
    index = load_index(REAL / f"{name}.onnx")
    hints = read_hints(GOLDEN / "real" / f"{name}.json")
    made = _count_sessions(monkeypatch)
    simulator = RankSimulator(shard_model(index, hints), index.model, 2, ahead_workers=0)
    assert not made  # nothing is made ahead
    stages = [step for step in simulator.steps if hasattr(step, "sessions")]
    members = [stage for stage in stages if stage.leader not in (None, stage)]
    assert members
    simulator.run(make_feeds(index, resolve_dims(index, hints, 8, {}), seed=0))
    assert len(made) == len(stages) - len(members)
    assert all(not stage.sessions for stage in members)
    assert all(stage.ahead.session is stage.leader.ahead.session for stage in members)
