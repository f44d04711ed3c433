"""The CP simulator: N ranks in one process, compared with the single-device run.

Right hints must match at 2 and 4 ranks; wrong hints must fail and name the first tensor that
differs (never a false pass). Hints are written by hand from fixtures/real/TRUTH.json, or come
from ``shardcheck gen`` where that is the point of the test.
"""

from __future__ import annotations

import json
import threading
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, GOLDEN, attention_model, run_cli
from onnx import TensorProto, helper

from shardcheck import load_index, read_hints, verify
from shardcheck.errors import InputError
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.hints.codec import dumps
from shardcheck.hints.model import AttentionLayerHint, DistCollective, ShardHints, ShardTensor
from shardcheck.runtime.background import InBackground
from shardcheck.runtime.feeds import make_feeds
from shardcheck.runtime.sessions import run_model
from shardcheck.runtime.sizes import resolve_dims
from shardcheck.sharding.rewrite import shard_model
from shardcheck.simulation import ahead
from shardcheck.simulation.ahead import AHEAD_WORKERS
from shardcheck.simulation.collectives import REDUCERS
from shardcheck.simulation.compare import compare_to_slice, compare_values
from shardcheck.simulation.plan import toposorted
from shardcheck.simulation.simulate import ReferenceRun, Simulation, SimulationResult, simulate
from shardcheck.simulation.simulator import RankSimulator

REAL = FIXTURES / "real"


@cache
def truth() -> dict:
    return json.loads((REAL / "TRUTH.json").read_text())


def truth_hints(name: str) -> ShardHints:
    """Graph-input hints as TRUTH.json records the model: every sequence input scattered, the
    outputs gathered, K and V gathered on their sequence axes."""
    model = truth()[name]
    first = model["attention_nodes"][0]
    return ShardHints(
        attention_layers=tuple(
            AttentionLayerHint(q=layer["q_tensor"], gather_kv=True, gather_q=False)
            for layer in model["attention_nodes"]
        ),
        inputs=tuple(ShardTensor(n, i) for n, i in model["inputs"].items() if i is not None),
        outputs=tuple(ShardTensor(n, i) for n, i in model["outputs"].items()),
        k_seq_len_idx=first["k_seq_axis"],
        v_seq_len_idx=first["v_seq_axis"],
        kv_rank=first["k_rank"],
    )


def sdpa_hints(**changes: object) -> ShardHints:
    # K enters the score MatMul transposed ([B, H, D, S]): its sequence axis is 3.
    hints = truth_hints("ts_sdpa")
    assert (hints.k_seq_len_idx, hints.v_seq_len_idx) == (3, 2)
    return hints.with_changes(**changes)


def assert_match(result: SimulationResult) -> None:
    assert result.ok, result.summary()
    assert result.mismatch is None
    assert result.summary().startswith("match: ")


def assert_culprit(
    result: SimulationResult,
    tensor: str,
    node: str,
    rank: int | None = None,
    *,
    failed: bool = False,
) -> None:
    """``failed``: the rank could not compute ``tensor`` at all (onnxruntime refused its
    inputs, or a collective its shape), rather than computing a different value."""
    assert not result.ok, result.summary()
    assert result.mismatch is not None
    assert (result.mismatch.tensor, result.mismatch.node) == (tensor, node), result.summary()
    if rank is not None:
        assert result.mismatch.rank == rank
    summary = result.summary()
    assert result.mismatch.failed == failed, summary
    says = "cannot compute tensor" if failed else "at tensor"
    first = "" if failed else "first difference on "
    assert summary.startswith(f"mismatch: {first}rank {result.mismatch.rank} {says} "), summary
    assert repr(tensor) in summary and repr(node) in summary and "\n" not in summary


# --------------------------------------------------------------------------- right hints


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["ts_sdpa", "dynamo_sdpa", "dynamo_sdpa_opset23"])
def test_right_hints_match_without_positions(name: str, ranks: int) -> None:
    assert_match(simulate(REAL / f"{name}.onnx", truth_hints(name), ranks=ranks, seq_len=8))


def test_right_hints_match_at_batch_2_and_length_16() -> None:
    result = simulate(REAL / "ts_sdpa.onnx", sdpa_hints(), ranks=4, seq_len=16, dims={"batch": 2})
    assert_match(result)
    assert result.dims == {"batch": 2, "sequence": 16}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize(
    "name", ["attention", "attention_head", "sdpa_scaled_attention", "scaled_masked_attention"]
)
def test_golden_hints_of_the_fixtures_match(name: str, ranks: int) -> None:
    result = simulate(FIXTURES / f"{name}.onnx", GOLDEN / f"{name}.json", ranks=ranks, seq_len=8)
    assert_match(result)


# The CP frontier of the decoders, placed by hand: the hidden states after the embeddings (the
# positions are added on the full sequence), the causal mask after its Expand (the last node
# that reads the full length), cos/sin of the rotary positions; GPT-2's output is gathered
# before its final Reshape, whose target shape is read from the full-length input_ids.
DECODER_FRONTIERS = {
    "ts_gpt2_tiny": (
        [("/model/Add_output_0", 1, 3), ("/model/Expand_output_0", 2, 4)],
        [("/model/ln_f/LayerNormalization_output_0", 1, 3)],
    ),
    "ts_llama_tiny_gqa": (
        [
            ("/model/layers.0/input_layernorm/Cast_output_0", 1, 3),
            ("/model/Expand_output_0", 2, 4),
            ("/model/layers.0/self_attn/Unsqueeze_6_output_0", 2, 4),
            ("/model/layers.0/self_attn/Unsqueeze_7_output_0", 2, 4),
        ],
        [("last_hidden_state", 1, 3)],
    ),
}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", sorted(DECODER_FRONTIERS))
def test_frontier_hints_match_on_decoders_with_positions_and_causal_masks(
    name: str, ranks: int
) -> None:
    hints = frontier_hints(name)
    assert_match(simulate(REAL / f"{name}.onnx", hints, ranks=ranks, seq_len=8))
    assert_match(simulate(REAL / f"{name}.onnx", hints, ranks=ranks, seq_len=16, dims={"batch": 2}))


DEFAULT_GEN_MODELS = [
    # encoders, learned or no positions
    "ts_bert_tiny",
    "ts_roberta_tiny_eager",
    "ts_transformer_encoder",
    "ts_manual_attention_mask",
    "ts_sdpa",
    "dynamo_sdpa",
    "dynamo_sdpa_opset23",
    # decoders: learned or rotary positions, causal masks built before the attention
    "ts_gpt2_tiny",
    "dynamo_gpt2_tiny",
    "ts_llama_tiny_gqa",
    "dynamo_llama_tiny_gqa",
    "ts_sdpa_causal",
]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", DEFAULT_GEN_MODELS)
def test_default_gen_hints_match(name: str, ranks: int) -> None:
    index = load_index(REAL / f"{name}.onnx")
    hints = generate(index, GenOptions()).hints
    assert_match(simulate(REAL / f"{name}.onnx", hints, ranks=ranks, seq_len=8))


# --------------------------------------------------------------------------- wrong hints


@pytest.mark.parametrize(
    ("name", "tensor", "node"),
    [
        # learned positions from Range(0, local length): rank 1 gets positions 0..3 again
        ("ts_gpt2_tiny", "/model/Range_output_0", "/model/Range"),
        ("dynamo_gpt2_tiny", "arange", "node_arange"),
        # rotary positions from the local length
        ("ts_llama_tiny_gqa", "/model/Range_output_0", "/model/Range"),
        ("dynamo_llama_tiny_gqa", "arange", "node_arange"),
        # BERT slices its position_ids buffer to the local length
        (
            "ts_bert_tiny",
            "/model/embeddings/position_embeddings/Gather_output_0",
            "/model/embeddings/position_embeddings/Gather",
        ),
        # RoBERTa's positions are a cumulative sum along the (local) sequence
        ("ts_roberta_tiny_eager", "/model/embeddings/CumSum_output_0", "/model/embeddings/CumSum"),
        # the causal mask of is_causal=True is built at the local length [4, 4] instead of [4, 8]
        ("ts_sdpa_causal", "/Expand_output_0", "/Expand"),
    ],
)
def test_graph_input_hints_fail_where_positions_or_masks_use_the_local_length(
    name: str, tensor: str, node: str
) -> None:
    result = simulate(REAL / f"{name}.onnx", truth_hints(name), ranks=2, seq_len=8)
    assert_culprit(result, tensor, node)


@pytest.mark.parametrize("reduce_op", ["sum", "prod"])
def test_summing_replicated_inputs_fails_at_the_reduce_scatter(reduce_op: str) -> None:
    hints = sdpa_hints(dist_collectives=DistCollective(reduce_op=reduce_op))
    result = simulate(REAL / "ts_sdpa.onnx", hints, ranks=2, seq_len=8)
    assert_culprit(result, "x/reduce_scatter", "x/reduce_scatter/on_axis0", rank=0)
    assert result.mismatch is not None and result.mismatch.original == "x"
    assert "differs from its slice of the single-device tensor along axis 1" in result.summary()


@pytest.mark.parametrize("reduce_op", ["max", "min", "avg"])
def test_idempotent_reductions_of_replicated_inputs_match(reduce_op: str) -> None:
    hints = sdpa_hints(dist_collectives=DistCollective(reduce_op=reduce_op))
    assert_match(simulate(REAL / "ts_sdpa.onnx", hints, ranks=2, seq_len=8))


def test_a_k_index_on_the_wrong_axis_fails_at_the_k_gather() -> None:
    result = simulate(REAL / "ts_sdpa.onnx", sdpa_hints(k_seq_len_idx=2), ranks=2, seq_len=8)
    assert_culprit(result, "/Mul_1_output_0/all_gather", "/Mul_1_output_0/all_gather/on_axis0")
    assert "its shape [1, 2, 32, 4] is neither the single-device shape [1, 2, 16, 8]" in (
        result.summary()
    )


def test_a_wrong_input_index_fails_where_the_slice_stops_fitting() -> None:
    # Scattering x's hidden axis is a valid slice of x, but the projection cannot take it.
    hints = sdpa_hints(inputs=(ShardTensor("x", 2),))
    result = simulate(REAL / "ts_sdpa.onnx", hints, ranks=2, seq_len=8)
    assert_culprit(result, "/q_proj/MatMul_output_0", "/q_proj/MatMul", failed=True)
    assert "onnxruntime:" in result.summary()


def test_a_wrong_output_index_fails_at_the_output_gather() -> None:
    hints = sdpa_hints(outputs=(ShardTensor("y", 2),))
    result = simulate(REAL / "ts_sdpa.onnx", hints, ranks=2, seq_len=8)
    assert_culprit(result, "y/all_gather", "y/all_gather/on_axis0")
    assert "[1, 4, 64]" in result.summary()


def test_an_output_left_out_of_the_hints_fails_on_its_shape() -> None:
    result = simulate(REAL / "ts_sdpa.onnx", sdpa_hints(outputs=()), ranks=2, seq_len=8)
    assert_culprit(result, "y", "/out_proj/Add")
    assert "the graph output has shape [1, 4, 32] on the rank but [1, 8, 32]" in result.summary()


def test_a_baked_length_fails_at_the_reshape_that_holds_it() -> None:
    result = simulate(
        REAL / "ts_mha_seq_first.onnx", truth_hints("ts_mha_seq_first"), ranks=2, seq_len=8
    )
    assert_culprit(result, "/attn/Reshape_4_output_0", "/attn/Reshape_4", failed=True)


def test_a_scatter_that_does_not_divide_fails_on_it() -> None:
    hints = read_hints(GOLDEN / "attention_head.json").with_changes(
        inputs=(ShardTensor("input", 2),)  # the hidden axis, 16, at 3 ranks
    )
    result = simulate(FIXTURES / "attention_head.onnx", hints, ranks=3, seq_len=6)
    assert_culprit(result, "input/reduce_scatter", "input/reduce_scatter/on_axis0", failed=True)
    assert "the reduce-scatter axis (2) has length 16, which is not a multiple of the 3 ranks" in (
        result.summary()
    )


# --------------------------------------------------------------------------- arguments


def test_a_length_that_does_not_divide_is_a_one_line_error() -> None:
    with pytest.raises(InputError) as error:
        simulate(REAL / "ts_sdpa.onnx", sdpa_hints(), ranks=4, seq_len=6)
    assert str(error.value) == (
        "--seq-len 6: the sequence length must be a positive multiple of the 4 ranks, so that "
        "every rank holds as many positions"
    )


def test_a_model_that_does_not_run_at_the_length_is_an_input_error() -> None:
    with pytest.raises(InputError, match="the single-device model does not run with dims"):
        simulate(
            REAL / "ts_mha_seq_first.onnx", truth_hints("ts_mha_seq_first"), ranks=2, seq_len=16
        )


# --------------------------------------------------------------------------- collectives


def _identity_model(directory: Path) -> Path:
    nodes = [
        helper.make_node("Identity", ["x"], ["local"], name="first"),
        helper.make_node("Identity", ["local"], ["y"], name="second"),
    ]
    graph = helper.make_graph(
        nodes,
        "identities",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["s", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["s", 3])],
    )
    path = directory / "identities.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path
    )
    return path


@pytest.mark.parametrize("reduce_op", sorted(REDUCERS))
def test_collectives_compute_what_their_attributes_say(reduce_op: str, tmp_path: Path) -> None:
    """x is scattered (the ranks' copies are equal), then ``local`` (the copies differ), then
    y is all-gathered; every step is checked against its definition in numpy."""
    ranks = 2
    path = _identity_model(tmp_path)
    index = load_index(path)
    hints = ShardHints(
        inputs=(ShardTensor("x", 0), ShardTensor("local", 0)),
        outputs=(ShardTensor("y", 0),),
        dist_collectives=DistCollective(reduce_op=reduce_op),
    )
    sharded = shard_model(index, hints)
    simulator = RankSimulator(sharded, index.model, ranks)
    x = np.arange(1, 25, dtype=np.float32).reshape(8, 3) / 8
    values = simulator.run({"x": x}).per_rank

    def reduce_scatter(copies: list[np.ndarray]) -> list[np.ndarray]:
        reduced = {
            "sum": np.sum,
            "prod": np.prod,
            "min": np.min,
            "max": np.max,
            "avg": np.mean,
        }[reduce_op](np.stack(copies), axis=0)
        return np.split(reduced, ranks, axis=0)

    first = reduce_scatter([x] * ranks)
    second = reduce_scatter(first)
    for rank in range(ranks):
        np.testing.assert_allclose(values[rank]["x/reduce_scatter"], first[rank], rtol=1e-6)
        np.testing.assert_allclose(values[rank]["local/reduce_scatter"], second[rank], rtol=1e-6)
        np.testing.assert_allclose(values[rank]["y/all_gather"], np.concatenate(second), rtol=1e-6)


def _scatter_and_gather(tmp_path: Path, groups: tuple[int, ...]) -> tuple[Any, np.ndarray]:
    index = load_index(_identity_model(tmp_path))
    hints = ShardHints(
        inputs=(ShardTensor("x", 0),),
        outputs=(ShardTensor("y", 0),),
        dist_collectives=DistCollective(groups=groups),
    )
    simulator = RankSimulator(shard_model(index, hints), index.model, 2)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    return simulator.run({"x": x}, diagnostic=True), x


def test_a_group_in_another_order_scatters_and_gathers_in_that_order(tmp_path: Path) -> None:
    # groups [1, 0]: rank 1 is first in the group, so it takes the first chunk, and the
    # gather puts its piece first: what comes out is what went in.
    values, x = _scatter_and_gather(tmp_path, (1, 0))
    assert values.failure is None
    np.testing.assert_array_equal(values.per_rank[1]["x/reduce_scatter"], x[:2])
    np.testing.assert_array_equal(values.per_rank[0]["x/reduce_scatter"], x[2:])
    np.testing.assert_array_equal(values.per_rank[0]["y/all_gather"], x)


def test_a_rank_outside_the_group_takes_no_part_and_is_named(tmp_path: Path) -> None:
    values, _ = _scatter_and_gather(tmp_path, (0,))
    assert values.failure is not None
    assert (values.failure.rank, values.failure.node) == (1, "x/reduce_scatter")
    assert "rank 1 is not in the reduce_scatter's group (ranks 0)" in values.failure.message


def test_sub_group_hints_are_simulated_and_their_missing_ranks_named(tmp_path: Path) -> None:
    hints = tmp_path / "groups.json"
    model = FIXTURES / "attention_head.onnx"
    assert run_cli("gen", model, "-o", hints, "--groups", "0", "1").exit_code == 0
    result = run_cli("simulate", model, hints, "--ranks", "4", "--seq-len", "8")
    assert result.exit_code == 1
    assert "rank 2 cannot compute tensor" in result.stdout
    assert "rank 2 is not in the reduce_scatter's group (ranks 0, 1)" in result.stdout
    assert run_cli("simulate", model, hints, "--ranks", "2", "--seq-len", "8").exit_code == 0


def test_a_group_naming_a_rank_not_simulated_is_a_one_line_error(tmp_path: Path) -> None:
    hints = tmp_path / "groups.json"
    model = FIXTURES / "attention_head.onnx"
    assert run_cli("gen", model, "-o", hints, "--groups", "0", "3").exit_code == 0
    for argv in (["simulate", "--seq-len", "8"], ["verify", "--seq-lens", "8,16"]):
        result = run_cli(argv[0], model, hints, "--ranks", "2", *argv[1:])
        assert result.exit_code == 2
        assert result.stderr == (
            f"shardcheck: error: {hints}: dist_collectives: groups [0, 3], group_size 0: the "
            "group names rank 3, but 2 ranks (0 to 1) are simulated; simulate with --ranks "
            "covering the group\n"
        )


def test_stages_are_planned_on_a_topological_order_with_every_node_named() -> None:
    """The graph's own order when it is one (the nodes are kept, not copied); else a
    topological one. An unnamed node is replaced by a named copy."""
    nodes = [
        helper.make_node("Relu", ["a"], ["b"], name="first"),
        helper.make_node("Relu", ["b"], ["c"]),
        helper.make_node("Relu", ["c"], ["d"], name="last"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, [2])],
    )
    ordered, reads = toposorted(graph)
    assert [n.name for n in ordered] == ["first", "<unnamed Relu #1>", "last"]
    assert ordered[0] is graph.node[0] and not graph.node[1].name
    assert reads == [["a"], ["b"], ["c"]]

    graph.node.reverse()  # last, unnamed, first: each reads what a later node makes
    ordered, reads = toposorted(graph)
    assert [n.name for n in ordered] == ["first", "<unnamed Relu #1>", "last"]
    assert reads == [["a"], ["b"], ["c"]]


# --------------------------------------------------------------------------- cost


def test_the_happy_path_runs_each_stage_once_per_rank_and_nothing_else() -> None:
    """One session per stage, built once; a stage runs once per rank (once in all when its
    inputs are the same on every rank); stages return only what later steps read; plus the one
    single-device run: about N + 1 inferences of the model."""
    ranks = 4
    name = "ts_gpt2_tiny"
    hints = frontier_hints(name)
    index = load_index(REAL / f"{name}.onnx")
    simulator = RankSimulator(shard_model(index, hints), index.model, ranks)
    feeds = make_feeds(index, resolve_dims(index, hints, 8, {}), seed=0)
    values = simulator.run(feeds)

    stages = [step for step in simulator.steps if hasattr(step, "sessions")]
    assert all(len(stage.sessions) == 1 for stage in stages)
    replicated_stages = 1  # stage 0 reads the replicated graph inputs only
    assert simulator.session_runs == replicated_stages + ranks * (len(stages) - 1)
    later_reads = {name for step in simulator.steps for name in _reads(step)}
    later_reads.update(o.name for o in simulator.sharded.model.graph.output)
    for stage in stages:
        assert set(stage.outputs) <= later_reads
        assert len(stage.outputs) < len(stage.produced)
    assert all("last_hidden_state" in rank_values for rank_values in values.per_rank)

    result = simulate(REAL / f"{name}.onnx", hints, ranks=ranks, seq_len=8)
    assert_match(result)
    assert result.session_runs == simulator.session_runs + 1


def test_the_single_device_session_is_made_while_the_model_is_analysed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a reference from the caller, the single-device run is the reference; its
    session (about one inference of the model) is made in a background thread that starts
    before shape inference, detection and sharding, which run meanwhile."""
    import threading

    from shardcheck.simulation import simulate as module

    events: list[tuple[str, str]] = []
    real_session, real_shapes, real_background = (
        module.make_session,
        module.ShapeInference,
        module.InBackground,
    )

    def session(*args: Any, **kwargs: Any) -> Any:
        events.append(("session", threading.current_thread().name))
        return real_session(*args, **kwargs)

    def shapes(*args: Any) -> Any:
        events.append(("shapes", threading.current_thread().name))
        return real_shapes(*args)

    def background(name: str, *args: Any) -> Any:
        events.append(("started", name))
        return real_background(name, *args)

    monkeypatch.setattr(module, "make_session", session)
    monkeypatch.setattr(module, "ShapeInference", shapes)
    monkeypatch.setattr(module, "InBackground", background)
    name = "ts_gpt2_tiny"
    assert_match(simulate(REAL / f"{name}.onnx", frontier_hints(name), ranks=2, seq_len=8))
    main = threading.main_thread().name
    started = events.index(("started", "shardcheck-single-device"))
    assert started < events.index(("shapes", main))
    # One session, made in that thread (the stages' are ahead.py's).
    assert [event for event in events if event[0] == "session"] == [
        ("session", "shardcheck-single-device")
    ]


def test_a_background_call_hands_its_value_or_its_exception_to_the_caller() -> None:
    assert InBackground("t", sum, [1, 2, 3]).result() == 6
    failing = InBackground("t", int, "not a number")
    assert failing.wait(10.0)
    with pytest.raises(ValueError, match="not a number"):
        failing.result()


def _stages(simulator: RankSimulator) -> list[Any]:
    return [step for step in simulator.steps if hasattr(step, "sessions")]


def test_stage_sessions_are_made_ahead_by_workers_and_used_by_the_runs() -> None:
    name = "ts_gpt2_tiny"
    hints = frontier_hints(name)
    index = load_index(REAL / f"{name}.onnx")
    simulator = RankSimulator(shard_model(index, hints), index.model, 2)
    stages = _stages(simulator)
    # Every stage's inputs are typed (the rules cover the export): workers make them all.
    assert all(stage.ahead is not None for stage in stages)
    assert all(stage.ahead.done.wait(60.0) for stage in stages)
    assert all(stage.ahead.session is not None for stage in stages)
    feeds = make_feeds(index, resolve_dims(index, hints, 8, {}), seed=0)
    values = simulator.run(feeds)
    assert all("last_hidden_state" in rank_values for rank_values in values.per_rank)
    assert all(stage.sessions == {(frozenset(), False): stage.ahead.session} for stage in stages)


def test_stopped_workers_take_no_more_stages_and_the_runs_make_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verify stops the workers of a simulation it will not run (the model did not run); the
    sessions they are making are waited for, so that no onnxruntime work is left running."""
    make = ahead.make_session
    release = threading.Event()
    holding = threading.Semaphore(0)

    def held_in_workers(*args: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            holding.release()
            release.wait(60.0)
        return make(*args)

    monkeypatch.setattr(ahead, "make_session", held_in_workers)
    name = "ts_gpt2_tiny"
    hints = frontier_hints(name)
    index = load_index(REAL / f"{name}.onnx")
    simulator = RankSimulator(shard_model(index, hints), index.model, 2)
    stages = _stages(simulator)
    assert all(holding.acquire(timeout=60.0) for _ in range(AHEAD_WORKERS))
    threading.Timer(0.5, release.set).start()
    simulator.stop_making_ahead()  # each worker holds the one stage it took, till released
    assert release.is_set()  # it waited for them
    taken = [stage for stage in stages if stage.ahead.state == "making"]
    assert len(taken) == AHEAD_WORKERS < len(stages)
    assert all(stage.ahead.done.is_set() for stage in taken)
    assert all(stage.ahead.state == "skipped" for stage in stages if stage not in taken)
    feeds = make_feeds(index, resolve_dims(index, hints, 8, {}), seed=0)
    values = simulator.run(feeds)
    assert all("last_hidden_state" in rank_values for rank_values in values.per_rank)


def test_a_run_that_stops_early_leaves_no_stage_session_being_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mismatch ends the run before it has asked for every stage; the workers, slowed here,
    still had stages to make: they take no more, and the ones they hold are finished when run
    returns (before, they went on making sessions behind it)."""
    import time

    make = ahead.make_session

    def slow_in_workers(*args: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        return make(*args)

    monkeypatch.setattr(ahead, "make_session", slow_in_workers)
    name = "ts_gpt2_tiny"
    wrong = frontier_hints(name).with_changes(k_seq_len_idx=1)
    simulation = Simulation(REAL / f"{name}.onnx", wrong, ranks=2)
    result = simulation.run(8)
    assert not result.ok
    aheads = [stage.ahead for stage in _stages(simulation.simulator)]
    assert all(made.state == "skipped" or made.done.is_set() for made in aheads)


def test_a_stage_whose_inferred_types_are_wrong_is_made_from_the_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inferred types only decide which sessions can be made early: a session made for
    other types than the values have is not used, and the runs make the stage's session."""
    infer = ahead.infer_elem_types

    def wrong_for_ints(*args: Any, **kwargs: Any) -> dict[str, int]:
        types = infer(*args, **kwargs)
        return {n: TensorProto.INT32 if t == TensorProto.INT64 else t for n, t in types.items()}

    monkeypatch.setattr(ahead, "infer_elem_types", wrong_for_ints)
    name = "ts_gpt2_tiny"
    hints = frontier_hints(name)
    index = load_index(REAL / f"{name}.onnx")
    simulator = RankSimulator(shard_model(index, hints), index.model, 2)
    mistyped = [
        (stage, stage.ahead)
        for stage in _stages(simulator)
        if TensorProto.INT32 in stage.ahead.types
    ]
    assert mistyped  # the stage reading input_ids at least
    feeds = make_feeds(index, resolve_dims(index, hints, 8, {}), seed=0)
    values = simulator.run(feeds)
    assert all("last_hidden_state" in rank_values for rank_values in values.per_rank)
    for stage, made_ahead in mistyped:
        made_ahead.done.wait(60.0)
        assert stage.sessions[(frozenset(), False)] is not made_ahead.session


def test_a_stage_a_worker_cannot_make_is_made_by_the_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make = ahead.make_session

    def only_in_the_main_thread(*args: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("no session from a worker")
        return make(*args)

    monkeypatch.setattr(ahead, "make_session", only_in_the_main_thread)
    name = "ts_gpt2_tiny"
    result = simulate(REAL / f"{name}.onnx", frontier_hints(name), ranks=2, seq_len=8)
    assert_match(result)


def test_a_simulation_serves_several_lengths_with_the_sessions_made_once() -> None:
    """verify simulates at each of its lengths: the sharded model, its stage sessions and the
    single-device session are made once; each length only runs them."""
    name = "ts_gpt2_tiny"
    hints = frontier_hints(name)
    simulation = Simulation(REAL / f"{name}.onnx", hints, ranks=2)
    stages = [step for step in simulation.simulator.steps if hasattr(step, "sessions")]
    first = simulation.run(8)
    assert_match(first)
    sessions = [session for stage in stages for session in stage.sessions.values()]
    single_device = simulation._single_device
    second = simulation.run(16)
    assert_match(second)
    assert [s for stage in stages for s in stage.sessions.values()] == sessions
    assert simulation._single_device is single_device
    assert (first.seq_len, second.seq_len) == (8, 16)


def test_the_reference_of_a_run_already_made_replaces_the_single_device_run() -> None:
    """verify passes its own runs' graph outputs: used when the dims and seed are the run's,
    ignored otherwise; a wrong reference is a mismatch (it is really compared with)."""
    name = "ts_gpt2_tiny"
    hints = frontier_hints(name)
    simulation = Simulation(REAL / f"{name}.onnx", hints, ranks=2)
    index = simulation.index
    dims = resolve_dims(index, hints, 8, {})
    feeds = make_feeds(index, dims, seed=3)
    single = run_model(simulation.model, feeds)
    before = simulation.simulator.session_runs
    used = simulation.run(8, seed=3, reference=ReferenceRun(dims, 3, single))
    assert_match(used)
    # Only the ranks' stage runs: no single-device run.
    assert used.session_runs == simulation.simulator.session_runs - before > 0

    wrong = {name: np.zeros_like(value) for name, value in single.items()}
    assert not simulation.run(8, seed=3, reference=ReferenceRun(dims, 3, wrong)).ok
    before = simulation.simulator.session_runs
    other_seed = simulation.run(8, seed=4, reference=ReferenceRun(dims, 3, wrong))
    assert_match(other_seed)  # not the same inputs: the reference is not used
    assert other_seed.session_runs == simulation.simulator.session_runs - before + 1


def frontier_hints(name: str) -> ShardHints:
    """TRUTH's hints with the frontier inputs and outputs of a decoder."""
    inputs, outputs = DECODER_FRONTIERS[name]
    return truth_hints(name).with_changes(
        inputs=tuple(ShardTensor(*t) for t in inputs),
        outputs=tuple(ShardTensor(*t) for t in outputs),
    )


def _reads(step: object) -> list[str]:
    if hasattr(step, "inputs"):
        return list(step.inputs)  # a stage
    return list(step.node.input)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- command line


def _write(path: Path, hints: ShardHints) -> Path:
    path.write_text(dumps(hints))
    return path


def test_cli_simulate_exit_codes(tmp_path: Path) -> None:
    model = REAL / "ts_sdpa.onnx"
    right = _write(tmp_path / "right.json", sdpa_hints())
    wrong = _write(tmp_path / "wrong.json", sdpa_hints(k_seq_len_idx=2))

    ok = run_cli("simulate", model, right, "--ranks", "2", "--seq-len", "8", "--dim", "batch=2")
    assert (ok.exit_code, ok.stderr) == (0, "")
    assert ok.stdout.startswith("match: ") and "dims batch=2, sequence=8" in ok.stdout

    bad = run_cli("simulate", model, wrong, "--ranks", "2", "--seq-len", "8")
    assert (bad.exit_code, bad.stderr) == (1, "")
    assert bad.stdout.startswith("mismatch: first difference on rank 0 at tensor ")
    assert bad.stdout.count("\n") == 1

    error = run_cli("simulate", model, right, "--ranks", "4", "--seq-len", "6")
    assert (error.exit_code, error.stdout) == (2, "")
    assert (
        error.stderr.startswith("shardcheck: error: --seq-len 6:") and error.stderr.count("\n") == 1
    )

    typo = run_cli("simulate", model, right, "--ranks", "2", "--seq-len", "8", "--dim", "batch")
    assert typo.exit_code == 2 and "expected NAME=VALUE" in typo.stderr


# --------------------------------------------------------------------------- comparing


def test_values_compare_with_tolerance_and_nan_and_infinities() -> None:
    inf, nan = np.inf, np.nan
    same = np.array([1.0, -inf, nan], dtype=np.float32)
    assert compare_values(same, same.copy(), 1e-4, 1e-5) == (True, 0.0)
    assert compare_values(same + np.float32(1e-6), same, 1e-4, 1e-5)[0]
    assert compare_values(np.array([nan]), np.array([1.0]), 1e-4, 1e-5) == (False, inf)
    assert compare_values(np.array([1, 5]), np.array([1, 2]), 1e-4, 1e-5) == (False, 3.0)


def test_a_rank_is_compared_with_its_slice_along_the_one_axis_that_differs() -> None:
    full = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    assert compare_to_slice(full[:, 2:], full, 1, 2, 1e-4, 1e-5) is None
    assert compare_to_slice(full[:, 2:], full, 0, 2, 1e-4, 1e-5) == (
        "its value differs from its slice of the single-device tensor along axis 1",
        6.0,
    )
    problem = compare_to_slice(full[:1, 2:], full, 1, 2, 1e-4, 1e-5)
    assert problem is not None and problem[0].startswith("its shape [1, 2, 3] is neither")


def test_a_model_with_external_weights_is_simulated(tmp_path: Path) -> None:
    path = attention_model(tmp_path, external=True)
    hints = ShardHints(
        attention_layers=(AttentionLayerHint(q="q", gather_kv=True, gather_q=False),),
        inputs=(ShardTensor("x", 0),),
        outputs=(ShardTensor("y", 0),),
        k_seq_len_idx=1,
        v_seq_len_idx=0,
    )
    assert_match(simulate(path, hints, ranks=2, seq_len=8))
    wrong = simulate(path, hints.with_changes(k_seq_len_idx=0), ranks=2, seq_len=8)
    assert_culprit(wrong, "k_T/all_gather", "k_T/all_gather")
    # verify reads the same weights for its own runs and its simulation.
    assert verify(path, hints, ranks=2).ok
    report = verify(path, hints.with_changes(k_seq_len_idx=0), ranks=2)
    assert ("SC105", "k_seq_len_idx") in [(f.code, f.field) for f in report.errors]


def position_table_hints(*, table: bool) -> ShardHints:
    """Hints of ``attention_model(positions=True)``: the tokens cut, the table too if ``table``."""
    cut = (ShardTensor("tokens", 0), *((ShardTensor("pos", 0),) if table else ()))
    return ShardHints(
        attention_layers=(AttentionLayerHint(q="q", gather_kv=True, gather_q=False),),
        inputs=cut,
        outputs=(ShardTensor("y", 0),),
        k_seq_len_idx=1,
        v_seq_len_idx=0,
    )


@pytest.mark.parametrize("external", [False, True])
def test_a_weight_the_hints_cut_gives_each_rank_its_rows(external: bool, tmp_path: Path) -> None:
    path = attention_model(tmp_path, positions=True, external=external)
    assert_match(simulate(path, position_table_hints(table=True), ranks=2, seq_len=8))
    assert_match(simulate(path, position_table_hints(table=True), ranks=4, seq_len=8))
    # Left whole, the table's 8 rows meet each rank's 4 positions.
    wrong = simulate(path, position_table_hints(table=False), ranks=2, seq_len=8)
    assert_culprit(wrong, "x", "add_positions", failed=True)


@pytest.mark.parametrize(
    ("ranks", "says"), [(1, "1 simulated rank, 4 stages"), (2, "2 simulated ranks, 4 stages")]
)
def test_the_summary_counts_ranks_and_stages_in_words(ranks: int, says: str) -> None:
    # A stage per level of collectives (plan.py): ts_sdpa's longest path has 3 (x's scatter,
    # K's gather, y's gather), so levels 0 to 3.
    result = simulate(REAL / "ts_sdpa.onnx", sdpa_hints(), ranks=ranks, seq_len=8)
    assert_match(result)
    assert f"; {says}, dims " in result.summary()


def test_a_length_the_inputs_fix_is_said_to_make_seq_len_ineffective() -> None:
    # ViT's sequence is its 17 patches: no input dim takes --seq-len.
    model, hints = REAL / "ts_vit_tiny.onnx", GOLDEN / "real" / "ts_vit_tiny.json"
    result = simulate(model, read_hints(hints), ranks=1, seq_len=8)
    assert_match(result)
    assert result.summary().endswith(
        "; the inputs fix the sequence length, so seq_len 8 had no effect."
    )
    assert not simulate(REAL / "ts_sdpa.onnx", sdpa_hints(), ranks=1, seq_len=8).length_fixed
