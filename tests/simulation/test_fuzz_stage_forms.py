"""Property test of stage forms (hypothesis, derandomized): however the stages of a model are
alike or differ (ops, attributes, wiring, constants, weight shapes), running stages of one form
on a shared session gives every rank exactly the values of one session per stage."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from shardcheck.hints.model import DistCollective
from shardcheck.sharding.rewrite import (
    ALL_GATHER,
    COLLECTIVE_OP,
    REDUCE_SCATTER,
    ShardedModel,
    collective_attributes,
)
from shardcheck.simulation.simulator import RankSimulator

# Each step maps a [rows, 3] float tensor to another of the same shape.
STEPS = st.sampled_from(
    [
        ("add_weight", 3),
        ("add_weight", 1),
        ("mul_weight", 3),
        ("relu",),
        ("leaky", 0.1),
        ("leaky", 0.2),
        ("add_self",),
        ("add_first",),
        ("softmax", 0),
        ("softmax", 1),
        ("transpose_twice",),
        ("add_constant", 1.0),
        ("add_constant", 2.0),
        ("add_negated_weight",),
    ]
)


class _Builder:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[Any] = []
        self.weights: list[TensorProto] = []
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def node(self, op: str, inputs: list[str], **attributes: Any) -> str:
        output = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def weight(self, width: int) -> str:
        name = self.name("w")
        values = self.rng.standard_normal(width).astype(np.float32)
        self.weights.append(numpy_helper.from_array(values, name))
        return name

    def collective(self, tensor: str, operation: str) -> str:
        output = self.name(operation)
        node = helper.make_node(COLLECTIVE_OP, [tensor], [output], name=output)
        node.attribute.extend(collective_attributes(DistCollective(), operation))
        self.nodes.append(node)
        return output

    def block(self, tensor: str, steps: list[tuple[Any, ...]]) -> str:
        first = tensor
        for step in steps:
            kind = step[0]
            if kind == "add_weight":
                tensor = self.node("Add", [tensor, self.weight(step[1])])
            elif kind == "mul_weight":
                tensor = self.node("Mul", [tensor, self.weight(step[1])])
            elif kind == "relu":
                tensor = self.node("Relu", [tensor])
            elif kind == "leaky":
                tensor = self.node("LeakyRelu", [tensor], alpha=step[1])
            elif kind == "add_self":
                tensor = self.node("Add", [tensor, tensor])
            elif kind == "add_first":
                tensor = self.node("Add", [tensor, first])
            elif kind == "softmax":
                tensor = self.node("Softmax", [tensor], axis=step[1])
            elif kind == "add_negated_weight":  # a node computed from a weight alone
                tensor = self.node("Add", [tensor, self.node("Neg", [self.weight(3)])])
            elif kind == "transpose_twice":
                tensor = self.node(
                    "Transpose", [self.node("Transpose", [tensor], perm=[1, 0])], perm=[1, 0]
                )
            else:
                value = numpy_helper.from_array(np.full(3, step[1], dtype=np.float32))
                tensor = self.node("Add", [tensor, self.node("Constant", [], value=value)])
        return tensor


@settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Blocks alike but for one thing: what they read (wiring), an attribute, a constant, a weight.
@example(base=[("add_weight", 3), ("add_self",)], changes=[(1, ("add_first",))], seed=0)
@example(base=[("leaky", 0.1)], changes=[(0, ("leaky", 0.2))], seed=0)
@example(base=[("add_constant", 1.0)], changes=[(0, ("add_constant", 2.0))], seed=0)
@example(base=[("add_weight", 3)], changes=[(0, ("add_weight", 1))], seed=0)
@example(base=[("relu",), ("softmax", 1)], changes=[None, None], seed=0)
@example(base=[("add_negated_weight",)], changes=[None, (0, ("add_weight", 3))], seed=0)
@given(
    base=st.lists(STEPS, min_size=1, max_size=4),
    changes=st.lists(st.none() | st.tuples(st.integers(0, 3), STEPS), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_shared_sessions_give_the_values_of_one_session_per_stage(
    base: list[tuple[Any, ...]], changes: list[tuple[int, tuple[Any, ...]] | None], seed: int
) -> None:
    """x is reduce-scattered, then each block runs on every rank's part, its output
    all-gathered before the next: one stage per block. The first block has the ``base`` steps;
    each later one the same steps with at most one changed (another op, attribute, wiring,
    constant or weight shape), so that blocks are of one form or differ a little."""
    blocks = [base]
    for change in changes:
        steps = list(base)
        if change is not None:
            steps[change[0] % len(steps)] = change[1]
        blocks.append(steps)
    builder = _Builder(np.random.default_rng(seed))
    tensor = builder.collective("x", REDUCE_SCATTER)
    for steps in blocks:
        tensor = builder.collective(builder.block(tensor, steps), ALL_GATHER)
    graph = helper.make_graph(
        builder.nodes,
        "blocks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None)],
        builder.weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(seed + 1).standard_normal((4, 3)).astype(np.float32)

    shared = RankSimulator(ShardedModel(model), model, 2)
    stages = [step for step in shared.steps if hasattr(step, "sessions")]
    if all(steps == base for steps in blocks):
        assert sum(stage.leader not in (None, stage) for stage in stages) == len(blocks) - 1
    shared_values = shared.run({"x": x}).per_rank
    apart = RankSimulator(ShardedModel(model), model, 2, share_forms=False).run({"x": x}).per_rank
    for rank in range(2):
        assert np.array_equal(shared_values[rank][tensor], apart[rank][tensor])
