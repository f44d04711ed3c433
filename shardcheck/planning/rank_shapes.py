"""The shapes each rank sees: the multi-device model, its dims made concrete, inferred twice.

``shard_model`` writes the model every rank runs (the same one ``shardcheck shard`` writes). Its
graph inputs get the run's sizes and shape inference runs over it twice, with a rule for its
``DistCollective`` nodes: once on N ranks (a reduce-scatter divides axis 0 by N, an all-gather
multiplies it), once on one (both keep the shape: the single-device model, node for node). The
declared value_info (the whole model's shapes, with the run's sizes) is kept for the tensors
every rank holds whole, and dropped for those computed from a scattered tensor, whose shapes
on a rank differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from shardcheck.analysis.detect import AttentionLayer, gathered_by_q
from shardcheck.analysis.shapes import ExtraRule, ShapeInference
from shardcheck.analysis.symbolic import size_at
from shardcheck.analysis.tensor_info import UNKNOWN, TensorInfo
from shardcheck.graph import protos
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.hints.model import AttentionLayerHint, ShardHints
from shardcheck.sharding.lengths import copied_node
from shardcheck.sharding.rewrite import (
    ALL_GATHER,
    COLLECTIVE_OP,
    REDUCE_SCATTER,
    ShardedModel,
    after_scatters,
    collective_operation,
)
from shardcheck.sharding.rewrite import shard_model as _shard_model


@dataclass(frozen=True)
class RankShapes:
    """The multi-device model indexed, its shapes on one rank of N and on one device, and for
    each node of the original model the node of the multi-device one that is its copy."""

    sharded: ShardedModel
    index: GraphIndex
    on_rank: ShapeInference
    on_one: ShapeInference
    # original node index -> its node in ``index`` (none for a node the extension drops)
    copy_of: dict[int, Node]
    inserted: tuple[Node, ...]  # the collectives and Transposes shard inserted, the lengths added
    # original node index -> the copies of it that the extension computes with another
    # length (sharding/lengths.py), whether or not the original stays
    length_copies: dict[int, tuple[Node, ...]] = field(default_factory=dict)


def native_equivalent(hints: ShardHints) -> ShardHints:
    """Fused layers (``replace``) as the native layers they stand for: a fused multi-device
    attention computes its rank's queries against every key, as gathering K and V does."""
    layers = tuple(
        AttentionLayerHint(layer.q, gather_kv=True, gather_q=False, replace=None)
        if layer.replace is not None
        else layer
        for layer in hints.attention_layers
    )
    return replace(hints, attention_layers=layers)


def rank_shapes(
    index: GraphIndex,
    hints: ShardHints,
    dims: Mapping[str, int],
    ranks: int,
    *,
    hints_source: str = "<hints>",
    shapes: ShapeInference | None = None,
    layers: Sequence[AttentionLayer] | None = None,
    sharded: ShardedModel | None = None,
) -> RankShapes:
    """The multi-device model of ``hints`` and its shapes (``shapes``, ``layers``: the
    model's, when already found; ``sharded``: the multi-device model, when already made, which
    is made concrete in place). It is made without weights: only shapes are counted."""
    native = native_equivalent(hints)
    if sharded is None or native != hints:
        sharded = _shard_model(
            index,
            native,
            None if layers is None else gathered_by_q(layers),
            hints_source=hints_source,
            shapes=shapes,
            weights=False,
        )
    model = sharded.model
    _make_concrete(model, dims)
    sharded_index = GraphIndex(model, source=index.source)
    on_rank = ShapeInference(sharded_index, _collective_rules(ranks))
    on_one = ShapeInference(sharded_index, _collective_rules(1))
    original_tensors = set(index.producer)
    copies = [
        node
        for node in sharded_index.nodes
        if not node.outputs or any(name in original_tensors for name in node.outputs if name)
    ]
    inserted = tuple(
        node
        for node in sharded_index.nodes
        if node.outputs and not any(name in original_tensors for name in node.outputs if name)
    )
    # By the tensors they compute, not by position: the extension's shard drops the nodes whose
    # lengths only its copies compute now (sharding/lengths.py) and may order the rest anew, so
    # even the same number of nodes need not be the same nodes in the same order (dynamo
    # GPT-NeoX: its attention cores' counts went to the length computations before them).
    copy_by_output = {name: node for node in copies for name in node.outputs if name}
    copy_of = {
        node.index: copy_by_output[node.outputs[0]]
        for node in index.nodes
        if node.outputs and node.outputs[0] in copy_by_output
    }
    return RankShapes(
        sharded, sharded_index, on_rank, on_one, copy_of, inserted, _length_copies(index, inserted)
    )


def _length_copies(index: GraphIndex, nodes: Iterable[Node]) -> dict[int, tuple[Node, ...]]:
    """The extension's copies of original nodes computed with another length, by original
    node index: named after the node, of its op."""
    by_name = {node.name: node for node in index.nodes if node.name}
    found: dict[int, list[Node]] = {}
    for node in nodes:
        copied = copied_node(node.name) if node.name else None
        original = by_name.get(copied) if copied is not None else None
        if original is not None and original.op_type == node.op_type:
            found.setdefault(original.index, []).append(node)
    return {at: tuple(copies) for at, copies in found.items()}


def _make_concrete(model: protos.ModelProto, dims: Mapping[str, int]) -> None:
    graph = model.graph
    initializers = {tensor.name for tensor in graph.initializer}
    for graph_input in graph.input:
        if graph_input.name not in initializers:
            _set_sizes(graph_input, dims)
    affected = after_scatters(graph.node)
    kept = [info for info in graph.value_info if info.name not in affected]
    del graph.value_info[:]
    for info in kept:
        _set_sizes(info, dims)
        graph.value_info.append(info)


def _set_sizes(info: protos.ValueInfoProto, dims: Mapping[str, int]) -> None:
    for dim in info.type.tensor_type.shape.dim:
        if dim.HasField("dim_param"):
            size = size_at(dim.dim_param, dims)
            dim.Clear()
            if size is not None:
                dim.dim_value = size


def _collective_rules(ranks: int) -> dict[str, ExtraRule]:
    def rule(shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
        shape = shapes.input_info(node, 0).shape
        if shape is None or not shape or not isinstance(shape[0], int):
            return [UNKNOWN]
        operation = collective_operation(node.proto)
        first = shape[0]
        if operation == REDUCE_SCATTER:
            if first % ranks:
                return [UNKNOWN]
            first //= ranks
        elif operation == ALL_GATHER:
            first *= ranks
        return [TensorInfo((first, *shape[1:]))]

    return {COLLECTIVE_OP: rule}
