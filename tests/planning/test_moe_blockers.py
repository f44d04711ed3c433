"""explain's "what keeps work whole" for a mixture of experts that runs whole (issue 27).

Each model: one attention head over x [1, S, 16], then a mixture of 4 experts (top 1): a
router by [16, 4], TopK, each token's expert matrix a Gather of the stacked [4, 16, 16]
weights, multiplied by the token. Between the attention and the experts, one op the sequence
is not followed through, so gen gathers before it and every rank runs the experts whole: a
CumSum along the sequence (it mixes positions), or a dispatch that reorders the tokens by
their experts' indices (GatherElements along the sequence).

Then a copy into part of a tensor at positions given by value (a ScatterND no rule follows),
named with the dynamo exporter as the fix; and TorchScript's copy of DeepSeek-V3's K, which is
followed (analysis/index_grid.py), so nothing is named there.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, checked_model
from onnx import TensorProto
from onnx import helper as oh

from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.loader import load_index
from shardcheck.planning.plan import make_plan

D, E = 16, 4


def _weight(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return onnx.numpy_helper.from_array(values, name)


def _moe_model(between: str) -> onnx.ModelProto:
    nodes = [
        *(oh.make_node("MatMul", ["x", f"W_{p}"], [p], name=f"mm{p}") for p in "qkv"),
        oh.make_node("Transpose", ["k"], ["kT"], name="t", perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "kT"], ["scores"], name="scores"),
        oh.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["attended"], name="context"),
        oh.make_node("MatMul", ["attended", "W_router"], ["logits"], name="router"),
        oh.make_node("TopK", ["logits", "one"], ["top", "expert"], name="topk", axis=-1),
        oh.make_node("Squeeze", ["expert", "last"], ["expert_id"], name="squeeze_id"),
        oh.make_node("Gather", ["W_experts", "expert_id"], ["picked"], name="pick", axis=0),
    ]
    if between == "cumsum":
        nodes.append(oh.make_node("CumSum", ["attended", "seq_axis"], ["tokens"], name="cumsum"))
    else:  # each row of a token's hidden state read at its expert's index along the sequence
        nodes += [
            oh.make_node("Shape", ["attended"], ["attended_shape"], name="shape"),
            oh.make_node("Expand", ["expert", "attended_shape"], ["rows"], name="expand"),
            oh.make_node(
                "GatherElements", ["attended", "rows"], ["tokens"], name="dispatch", axis=1
            ),
        ]
    nodes += [
        oh.make_node("Unsqueeze", ["tokens", "minus_two"], ["token_rows"], name="rows_of"),
        oh.make_node("MatMul", ["token_rows", "picked"], ["expert_out"], name="expert"),
        oh.make_node("Squeeze", ["expert_out", "minus_two"], ["y"], name="squeeze_out"),
    ]
    ints = {"one": [1], "last": [-1], "seq_axis": 1, "minus_two": [-2]}
    constants = [
        onnx.numpy_helper.from_array(np.array(value, dtype=np.int64), name)
        for name, value in ints.items()
    ]
    weights = [_weight(f"W_{p}", (D, D), seed) for seed, p in enumerate("qkv")]
    weights += [_weight("W_router", (D, E), 3), _weight("W_experts", (E, D, D), 4)]
    shape = ["batch", "sequence", D]
    graph = oh.make_graph(
        nodes,
        f"moe_{between}",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        weights + constants,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize(
    ("between", "stop", "fix"),
    [
        ("cumsum", "CumSum cumsum", "an op that mixes positions keeps what follows it whole"),
        ("dispatch", "GatherElements dispatch", "export the experts batched"),
    ],
)
def test_whole_experts_are_named_with_what_keeps_them_whole(
    between: str, stop: str, fix: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / f"moe_{between}.onnx"
    onnx.save(_moe_model(between), str(path))
    index = load_index(path)
    plan = make_plan(index, generate(index, GenOptions()).hints, seq_len=64)
    # The attended tokens are gathered for the op after them, and so for the router too:
    # the router's product (2·16·4 per token) and the experts' (2·16·16) run whole; q, k
    # and v (3 of 2·16·16) on slices.
    assert plan.classes["projections"].whole == 64 * (2 * D * E + 2 * D * D)
    assert plan.classes["projections"].on_slices == 64 * 3 * 2 * D * D
    named = [b for b in plan.blockers if b.what.startswith("the experts run whole")]
    assert [b.what for b in named] == [
        f"the experts run whole: the sequence is not followed through {stop}"
    ]
    assert named[0].fix.startswith(fix)


def _copied_k_model() -> onnx.ModelProto:
    """Two residual layers (one head each), then an MLP; the second layer's K written into a
    buffer (another projection) by a ScatterND at indices given as a graph input: positions
    by value, which no rule follows."""

    def head(n: int, k: str) -> list[onnx.NodeProto]:
        return [
            oh.make_node("Transpose", [k], [f"kT{n}"], name=f"t{n}", perm=[0, 2, 1]),
            oh.make_node("MatMul", [f"q{n}", f"kT{n}"], [f"scores{n}"], name=f"scores{n}"),
            oh.make_node("Softmax", [f"scores{n}"], [f"probs{n}"], name=f"softmax{n}", axis=-1),
            oh.make_node("MatMul", [f"probs{n}", f"v{n}"], [f"out{n}"], name=f"context{n}"),
        ]

    def projected(x: str, *names: str) -> list[onnx.NodeProto]:
        return [oh.make_node("MatMul", [x, f"W_{p}"], [p], name=f"mm_{p}") for p in names]

    nodes = [
        *projected("x", "q1", "k1", "v1"),
        *head(1, "k1"),
        *projected("out1", "o1"),
        oh.make_node("Add", ["x", "o1"], ["h1"], name="residual1"),
        *projected("h1", "q2", "k2", "u2", "v2"),
        oh.make_node("ScatterND", ["u2", "where", "k2"], ["k_copy2"], name="copy"),
        *head(2, "k_copy2"),
        *projected("out2", "o2"),
        oh.make_node("Add", ["h1", "o2"], ["h2"], name="residual2"),
        *projected("h2", "up"),
        oh.make_node("Relu", ["up"], ["act"], name="relu"),
        *projected("act", "down"),
        oh.make_node("Add", ["h2", "down"], ["y"], name="residual3"),
    ]
    names = ["q1", "k1", "v1", "o1", "q2", "k2", "u2", "v2", "o2", "up", "down"]
    shape = ["batch", "sequence", D]
    graph = oh.make_graph(
        nodes,
        "copied_k",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, shape),
            oh.make_tensor_value_info("where", TensorProto.INT64, [*shape, 3]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [_weight(f"W_{p}", (D, D), seed) for seed, p in enumerate(names)],
    )
    return checked_model(graph)


def test_a_copy_at_positions_given_by_value_is_named_with_the_dynamo_fix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The copy's output is computed whole, so are k2 and u2, and the first layer's output h1
    # they read. So x is whole (q1, k1, v1 computed whole and scattered), o1 and o2 are
    # gathered for the residuals (each computed on its attention output's slice) and the
    # MLP after h2 runs whole: 2 of the 11 projections (2·16·16 per token) on slices.
    path = tmp_path / "copied_k.onnx"
    onnx.save(_copied_k_model(), str(path))
    index = load_index(path)
    plan = make_plan(index, generate(index, GenOptions()).hints, seq_len=64)
    assert plan.classes["projections"].on_slices == 2 * 64 * 2 * D * D
    assert plan.classes["projections"].whole == 9 * 64 * 2 * D * D
    [unfollowed] = [b for b in plan.blockers if "is not followed through" in b.what]
    assert unfollowed.what == "the sequence is not followed through ScatterND copy"
    assert unfollowed.fix.startswith("its indices address the sequence axis by value, not as")
    assert unfollowed.fix.endswith("export with torch.onnx.export(dynamo=True)")


def test_torchscript_copy_into_part_of_k_runs_on_slices_as_the_dynamo_one_does() -> None:
    # TorchScript's DeepSeek-V3 copies each head's K halves into a new buffer by a ScatterND
    # whose indices are a grid of every axis's own positions (analysis/index_grid.py): it is
    # followed, and both exports run every projection on slices.
    for name in ("ts_deepseek_v3_tiny", "dynamo_deepseek_v3_tiny"):
        index = load_index(FIXTURES / "real" / f"{name}.onnx")
        extended = generate(index, GenOptions()).extension
        assert extended is not None
        plan = make_plan(index, extended.hints)
        assert plan.classes["projections"].share_on_slices == 1.0, name
        assert not [b for b in plan.blockers if "is not followed through" in b.what], name
