"""The ``DistCollective`` nodes of a sharded model, run in numpy between the stages.

Each runs with the meaning of its attributes:

- ``reduce_scatter``: ``reduce_op`` (sum, prod, min, max, avg) across the ranks' copies, then
  the result is split along axis 0 into N equal chunks, chunk r to rank r;
- ``all_gather``: the ranks' tensors concatenated along axis 0, on every rank;
- ``all_reduce``: the sum across ranks, on every rank.

A collective runs among the ranks of its group: ``groups`` lists them (a rank's place in the
list is its place in the collective: its chunk of a reduce-scatter, its piece of an all-gather);
without, ``group_size`` g names ranks 0 to g - 1, and 0 every rank. A rank outside the group
takes no part and holds no result: a rank failure, named. ``root`` and ``nb_rank`` do not change
what these three collectives compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from shardcheck.errors import InputError
from shardcheck.graph.ops import is_default_domain
from shardcheck.runtime.weights import external_weight, is_external
from shardcheck.sharding.fused import is_fused_attention
from shardcheck.sharding.rewrite import ALL_GATHER, COLLECTIVE_OP, REDUCE_SCATTER
from shardcheck.simulation.fused_attention import FusedAttentionStep, fused_attention_step
from shardcheck.simulation.rank_values import RankFailure, RankValues

ALL_REDUCE = "all_reduce"
REDUCERS = {
    "sum": lambda stacked: stacked.sum(axis=0),
    "prod": lambda stacked: stacked.prod(axis=0),
    "min": lambda stacked: stacked.min(axis=0),
    "max": lambda stacked: stacked.max(axis=0),
    "avg": lambda stacked: stacked.mean(axis=0),
}


@dataclass(frozen=True)
class CollectiveStep:
    """A collective of the plan, between the stages whose tensors it reads and makes."""

    node: onnx.NodeProto
    operation: str
    reduce_op: str
    groups: tuple[int, ...] = ()  # the ranks taking part, in their order (none: see group_size)
    group_size: int = 0

    def group(self, ranks: int) -> tuple[int, ...]:
        """The ranks taking part when ``ranks`` are simulated."""
        if self.groups:
            return self.groups
        return tuple(range(self.group_size or ranks))


def is_collective(node: onnx.NodeProto) -> bool:
    """Whether ``node`` works across the ranks: a collective, or a fused multi-device
    Attention (which gathers K and V inside)."""
    return (node.op_type == COLLECTIVE_OP and is_default_domain(node.domain)) or is_fused_attention(
        node
    )


def collective_step(node: onnx.NodeProto) -> CollectiveStep | FusedAttentionStep:
    """The collective ``node`` as a step; InputError for one the simulator cannot run."""
    if is_fused_attention(node):
        return fused_attention_step(node)
    attributes = _attributes(node)
    operation = str(attributes.get("collective_operation", ""))
    reduce_op = str(attributes.get("reduce_op", "none"))
    where = f"node {node.name!r}"
    if operation not in (REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE):
        raise InputError(f"{where}: collective_operation {operation!r} cannot be simulated")
    if operation == REDUCE_SCATTER and reduce_op not in REDUCERS:
        raise InputError(f"{where}: reduce_op {reduce_op!r} cannot be simulated")
    if len(node.input) != 1 or len(node.output) != 1:
        raise InputError(f"{where}: a DistCollective has one input and one output")
    groups = tuple(int(rank) for rank in attributes.get("groups", []))
    return CollectiveStep(node, operation, reduce_op, groups, int(attributes.get("group_size", 0)))


def refuse_unknown_group_ranks(steps: Iterable[object], ranks: int) -> None:
    """InputError for a collective of ``steps`` whose group names a rank that is not
    simulated, a rank twice, or a ``group_size`` unlike its ``groups``."""
    for step in steps:
        if isinstance(step, CollectiveStep):
            refuse_bad_group(f"node {step.node.name!r}", step.groups, step.group_size, ranks)


def refuse_bad_group(where: str, groups: Sequence[int], group_size: int, ranks: int) -> None:
    """InputError for ``groups`` and ``group_size`` that name no group of the ``ranks``."""
    groups = list(groups)
    problem = ""
    if any(rank >= ranks for rank in groups):
        problem = f"names rank {max(groups)}, but {ranks} ranks (0 to {ranks - 1}) are simulated"
    elif len(set(groups)) != len(groups):
        problem = "names a rank twice"
    elif groups and group_size not in (0, len(groups)):
        problem = f"has {len(groups)} ranks, not group_size {group_size}"
    elif group_size > ranks:
        problem = f"group_size {group_size} is more than the {ranks} ranks simulated"
    if problem:
        raise InputError(
            f"{where}: groups {groups}, group_size {group_size}: the group {problem}; simulate "
            "with --ranks covering the group"
        )


def run_collective(
    step: CollectiveStep,
    values: RankValues,
    *,
    ranks: int,
    weights: Mapping[str, onnx.TensorProto],
    weights_dir: Path | None,
    scattered_axis: int,
) -> None:
    """Run ``step`` on every rank's ``values``, which take its result. ``scattered_axis``: the
    axis of the model's tensor that a reduce-scatter splits, named when it cannot."""
    source, target = step.node.input[0], step.node.output[0]
    if source in weights and source not in values.replicated:
        # A weight cut by the hints (a position table added whole): every rank holds it.
        tensor = weights[source]
        value = external_weight(tensor, weights_dir) if is_external(tensor) else None
        if value is None:
            value = numpy_helper.to_array(tensor, str(weights_dir) if weights_dir else "")
        values.set_replicated({source: value})
    group = step.group(ranks)
    outside = [rank for rank in range(ranks) if rank not in group]
    if outside:
        raise RankFailure(
            outside[0],
            step.node.name,
            f"rank {outside[0]} is not in the {step.operation}'s group (ranks "
            f"{', '.join(map(str, group))}): it takes no part and has no value of "
            f"{target!r}; the hints' groups or group_size shard the model on those ranks only",
        )
    if not all(source in values.per_rank[rank] for rank in group):
        raise RankFailure(group[0], step.node.name, f"no value of {source!r} on every rank")
    pieces = [values.per_rank[rank][source] for rank in group]
    if pieces[0].ndim == 0:
        raise RankFailure(0, step.node.name, f"{step.operation} of a scalar (no axis 0)")
    if len({piece.shape for piece in pieces}) > 1:
        raise RankFailure(
            0,
            step.node.name,
            f"{step.operation} of tensors whose shapes differ between ranks "
            f"({', '.join(str(list(piece.shape)) for piece in pieces)})",
        )
    if step.operation == ALL_GATHER:
        values.set_replicated({target: np.concatenate(pieces, axis=0)})
    elif step.operation == ALL_REDUCE:
        values.set_replicated({target: np.stack(pieces).sum(axis=0).astype(pieces[0].dtype)})
    else:
        reduced = REDUCERS[step.reduce_op](np.stack(pieces)).astype(pieces[0].dtype)
        if reduced.shape[0] % len(group):
            raise RankFailure(
                group[0],
                step.node.name,
                f"the reduce-scatter axis ({scattered_axis}) has length {reduced.shape[0]}, "
                f"which is not a multiple of the {len(group)} ranks",
            )
        for rank, chunk in zip(group, np.split(reduced, len(group), axis=0), strict=True):
            values.set_rank(rank, {target: chunk})


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}
