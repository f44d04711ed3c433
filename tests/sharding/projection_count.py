"""An independent count of the projection and MLP work that runs on slices in the
multi-device model ``shardcheck shard`` writes: planning/ counts it one way, this another.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from shardcheck.sharding.rewrite import COLLECTIVE_OP, REDUCE_SCATTER

# The ops the shard's model computes lengths with: a Shape of a slice is no slice of data.
LENGTH_OPS = frozenset(["Shape", "Size"])
# The ops a mixture of experts picks each token's experts' matrices out of their stack with.
PICKS = frozenset(["Gather", "GatherND"])


def projection_share_on_slices(multi_device: Path, top_k: int = 1) -> float:
    """The share of the projection and MLP FLOPs that run on slices in a multi-device model:
    each MatMul or Gemm by a 2-D weight (an initializer) costs 2·K·N per token, and each Conv of
    kernel 1 by a weight [M, C / group, 1] 2·M·C / group per position, the same number
    of tokens for each at one length (one whose data is computed from weights alone computes a
    table, not tokens: it is left out); a MatMul by a matrix that a Gather or GatherND picks out
    of stacked expert weights [E, N, K] costs 2·N·K for each of a token's ``top_k`` experts, and
    one expert's matrix so picked for the rows routed to it 2·N·K·top_k / E per token. It
    runs on slices when its data input is computed from a reduce-scatter's output and no
    all-gather lies between them."""
    graph = onnx.load(str(multi_device)).graph
    weights = {init.name: list(init.dims) for init in graph.initializer}
    picked = {
        node.output[0]: weights[node.input[0]][1:]
        for node in graph.node
        if node.op_type in PICKS and len(weights.get(node.input[0], ())) == 3
    }
    stacks = {
        node.output[0]: weights[node.input[0]][0] for node in graph.node if node.output[0] in picked
    }
    sliced: set[str] = set()
    from_inputs = {value.name for value in graph.input} - set(weights)
    on_slices = total = 0.0
    for node in graph.node:  # in a topological order, as the shard writes them
        if node.op_type not in LENGTH_OPS and from_inputs.intersection(node.input):
            from_inputs.update(node.output)
        if node.op_type == COLLECTIVE_OP:
            operation = next(
                a.s.decode() for a in node.attribute if a.name == "collective_operation"
            )
            if operation == REDUCE_SCATTER:
                sliced.update(node.output)
            continue
        if node.op_type in LENGTH_OPS:
            continue
        reads_slice = any(name in sliced for name in node.input)
        if reads_slice:
            sliced.update(node.output)
        if node.op_type not in ("MatMul", "Gemm", "Conv"):
            continue
        kernel = weights.get(node.input[1], ())
        if node.op_type == "Conv":
            if len(kernel) < 3 or any(size != 1 for size in kernel[2:]):
                continue
            # A Conv of kernel 1 is a projection of each position: [M, C / group, 1, ...].
            cost, data = 2 * kernel[0] * kernel[1], node.input[0]
        elif len(weights.get(node.input[1], ())) == 2:
            rows, columns = weights[node.input[1]]
            cost, data = 2 * rows * columns, node.input[0]
        elif node.op_type == "MatMul" and node.input[0] in picked:
            rows, columns = picked[node.input[0]]
            cost, data = 2 * rows * columns * top_k, node.input[1]
        elif node.input[1] in picked:
            # One expert's matrix, picked out of the stack for the rows routed to it (a sorting
            # dispatch's): k of every E experts' rows per token, on average.
            experts, (rows, columns) = stacks[node.input[1]], picked[node.input[1]]
            cost, data = 2 * rows * columns * top_k / experts, node.input[0]
        else:
            continue
        if data not in from_inputs:
            continue  # computed from weights alone: a table (DeBERTa's positions'), no token's
        total += cost
        on_slices += cost if data in sliced else 0
    assert total, "no projection found"
    return on_slices / total
