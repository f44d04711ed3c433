"""The FLOPs of CP hints for a model: on slices and whole, by class, at S and N ranks.

For a sequence length S and N ranks, every node of the model is counted twice on the
multi-device model (``rank_shapes``): with a rank's shapes and with one device's. A node runs on
slices when a rank's count is below the device's (its queries are a slice: a projection of the
rank's tokens, the scores of its queries against every key); else every rank runs it whole.

- ``flops_on_slices``: the share of the single-device FLOPs in nodes that run on slices;
- by class: the attention core (the nodes of each layer from its score product to its context
  product, or its fused node), projections and MLP (products with a weight operand), other;
- ``speedup_bound``: the single-device FLOPs over a rank's, the speed-up CP could reach if
  communication were free (Amdahl's bound: the whole-run work is never divided).

This is the first part of the plan (plan.py) and all that gen weighs its two plans by. It is
kept apart from the plan's memory count, which imports numpy: counting imports neither onnx
nor numpy, as gen's reading does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from shardcheck.analysis.baked import baked_lengths
from shardcheck.analysis.detect import AttentionLayer, sequence_dim
from shardcheck.analysis.selections import holds_selected_count
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import InputError
from shardcheck.frontier.kv_readers import kv_chains
from shardcheck.frontier.search import data_derived
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.hints.model import ShardHints
from shardcheck.planning.flops import PRODUCT_OPS, indexed_weights, node_flops
from shardcheck.planning.rank_shapes import RankShapes, rank_shapes
from shardcheck.runtime.settings import refuse_bad_ranks, refuse_bad_seq_len
from shardcheck.runtime.sizes import resolve_dims
from shardcheck.sharding.rewrite import COLLECTIVE_OP, REDUCE_SCATTER, ShardedModel

DEFAULT_SEQ_LEN = 4096
DEFAULT_RANKS = 2
CLASSES = ("attention", "projections", "other")
CLASS_TITLES = {
    "attention": "attention core",
    "projections": "projections and MLP",
    "other": "other",
}


@dataclass(frozen=True)
class ClassFlops:
    """Single-device FLOPs of one class: in nodes that run on slices, in nodes run whole."""

    on_slices: int = 0
    whole: int = 0

    @property
    def total(self) -> int:
        return self.on_slices + self.whole

    @property
    def share_on_slices(self) -> float:
        return self.on_slices / self.total if self.total else 0.0


@dataclass(frozen=True)
class FlopCount:
    """The FLOPs that the hints make each of ``ranks`` ranks compute at ``seq_len``
    (``dims``: every symbolic dim's size), by class, against one device: the first part of
    the plan, and all that gen weighs its two plans by (``count_flops``)."""

    model: str
    seq_len: int
    ranks: int
    dims: dict[str, int]
    classes: dict[str, ClassFlops]
    flops_per_rank: int
    uncounted_nodes: int  # nodes with FLOPs whose shapes are unknown (counted as 0)
    # Those of them that are projections or MLP (expert MatMuls after a data-dependent pick):
    # the share of that class leaves their FLOPs out, on slices or not.
    uncounted_projections: int
    # Those of them sized by what a selection picks (the rows an expert gets from a NonZero of
    # its routing: selections.py), which no shape tells before the model runs.
    uncounted_selected: int
    sliced_nodes: frozenset[int] = field(repr=False)

    @property
    def flops_total(self) -> int:
        return sum(c.total for c in self.classes.values())

    @property
    def flops_on_slices(self) -> float:
        total = self.flops_total
        return sum(c.on_slices for c in self.classes.values()) / total if total else 0.0

    @property
    def speedup_bound(self) -> float:
        return self.flops_total / self.flops_per_rank if self.flops_per_rank else 1.0


def count_flops(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    hints: ShardHints,
    *,
    seq_len: int | None = None,
    ranks: int = DEFAULT_RANKS,
    sharded: ShardedModel | None = None,
) -> FlopCount:
    """The FLOPs of ``make_plan``'s plan, counted the same way, and nothing else of it (no
    memory, traffic or blockers); ``shapes`` and ``layers``: the model's; ``sharded``: the
    multi-device model of ``hints``, when already made (it is made concrete in place)."""
    return count_with_shapes(
        index, hints, seq_len, ranks, None, "<hints>", shapes, layers, sharded
    )[0]


def count_with_shapes(
    index: GraphIndex,
    hints: ShardHints,
    seq_len: int | None,
    ranks: int,
    dims: Mapping[str, int] | None,
    hints_source: str,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    sharded: ShardedModel | None = None,
) -> tuple[FlopCount, RankShapes, Callable[[Node], str]]:
    """The FLOPs, the shapes they were counted from and each node's class."""
    refuse_bad_ranks(ranks)
    asked = seq_len
    seq_len = _length(index, shapes, layers, hints, seq_len)
    run_dims = resolve_dims(index, hints, seq_len, dims or {}, shapes)
    found = rank_shapes(
        index,
        hints,
        run_dims,
        ranks,
        hints_source=hints_source,
        shapes=shapes,
        layers=layers,
        sharded=sharded,
    )
    _refuse_uneven(index, found, ranks, seq_len, fixed=asked is None and seq_len != DEFAULT_SEQ_LEN)
    classes = {name: [0, 0] for name in CLASSES}
    per_rank = 0
    uncounted = uncounted_projections = uncounted_selected = 0
    sliced: set[int] = set()
    class_of = node_classes(index, shapes, layers)
    for node in index.nodes:
        copy = found.copy_of.get(node.index)
        again = found.length_copies.get(node.index, ())
        if copy is not None:
            one, on_rank = node_flops(found.on_one, copy), node_flops(found.on_rank, copy)
        elif again:
            # Computed by the extension's copies alone, with the whole length (positions and
            # masks, whole on every rank): on one device, as the first of them computes it.
            one, on_rank = node_flops(found.on_one, again[0]), 0
        else:
            continue  # nothing reads it in the multi-device model: it is dropped
        for extra in again:  # each copy runs on every rank, beside the original if it stays
            flops = node_flops(found.on_rank, extra)
            on_rank = None if flops is None or on_rank is None else on_rank + flops
        if one is None or on_rank is None:
            uncounted += 1
            uncounted_projections += class_of(node) == "projections"
            uncounted_selected += _sized_by_selection(shapes, node)
            continue
        split = on_rank < one
        if split:
            sliced.add(node.index)
        classes[class_of(node)][0 if split else 1] += one
        per_rank += on_rank
    count = FlopCount(
        model=index.source,
        seq_len=seq_len,
        ranks=ranks,
        dims=dict(run_dims),
        classes={name: ClassFlops(*counts) for name, counts in classes.items()},
        flops_per_rank=per_rank,
        uncounted_nodes=uncounted,
        uncounted_projections=uncounted_projections,
        sliced_nodes=frozenset(sliced),
        uncounted_selected=uncounted_selected,
    )
    return count, found, class_of


def _length(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    hints: ShardHints,
    seq_len: int | None,
) -> int:
    """The length to count at: the one asked, or the default; a model that runs at one
    length only (a length baked into a Reshape, a query axis of fixed size) takes that one."""
    if seq_len is not None:
        refuse_bad_seq_len(seq_len)
    fixed: int | None = None
    seq = sequence_dim(shapes, layers) if layers else None
    if isinstance(seq, int):
        fixed, why = seq, f"its attention's query axis has {seq} positions"
    else:
        baked = baked_lengths(index, shapes, seq)
        if baked:
            node, length = baked[0]
            fixed, why = length, f"Reshape {node.label} holds the traced length {length}"
    if fixed is not None:
        if seq_len is not None and seq_len != fixed:
            raise InputError(
                f"{index.source}: --seq-len {seq_len}: the model runs at length {fixed} only "
                f"({why}); leave --seq-len out or give {fixed}"
            )
        return fixed
    return DEFAULT_SEQ_LEN if seq_len is None else seq_len


def _refuse_uneven(
    index: GraphIndex, found: RankShapes, ranks: int, seq_len: int, *, fixed: bool
) -> None:
    for node in found.inserted:
        if node.op_type != COLLECTIVE_OP or node.attr("collective_operation") not in (
            REDUCE_SCATTER,
            REDUCE_SCATTER.encode(),
        ):
            continue
        shape = found.on_one.shape(node.inputs[0])
        positions = shape[0] if shape else None
        tail = next(t for t in found.sharded.tails.values() if t.collective_node == node.name)
        if not isinstance(positions, int):
            # No length gives one: say where the shapes are lost, not to pick another length.
            lost = _shape_lost_at(found, node.inputs[0])
            where = f" past {lost.op_type} {lost.label}" if lost is not None else ""
            raise InputError(
                f"{index.source}: the scattered tensor {tail.source!r} has an unknown number of "
                f"positions on axis {tail.axis}: its shape is not inferred{where}, "
                "so the plan cannot be counted; verify runs the model all the same"
            )
        if positions % ranks:
            raise InputError(
                f"{index.source}: --seq-len {seq_len} --ranks {ranks}: the scattered tensor "
                f"{tail.source!r} has {positions} positions on axis {tail.axis} at this length, "
                f"not a multiple of {ranks}; "
                + (
                    "the model runs at this length only: give --ranks a divisor of it"
                    if fixed
                    else "pick a length that gives one"
                )
            )


def _sized_by_selection(shapes: ShapeInference, node: Node) -> bool:
    """Whether ``node`` computes on what a selection picks: a dim of one of its tensors, on the
    model, is computed from a selection's count."""
    for name in (*node.inputs, *node.outputs):
        shape = shapes.shape(name) if name else None
        if shape is not None and any(holds_selected_count(dim) for dim in shape):
            return True
    return False


def _shape_lost_at(found: RankShapes, tensor: str) -> Node | None:
    """The first node, in graph order, on the way to ``tensor`` whose output's shape on one
    device is unknown while its inputs' are known: where shape inference lost it."""
    index, on_one = found.index, found.on_one

    def known(name: str) -> bool:
        shape = on_one.shape(name)
        return shape is not None and all(isinstance(dim, int) for dim in shape)

    pending, seen, lost = [tensor], {tensor}, []
    while pending:
        producer = index.producer_of(pending.pop())
        if producer is None:
            continue
        inputs = [name for name in producer.inputs if name]
        unknown = [name for name in inputs if not known(name)]
        if not unknown:
            lost.append(producer)
        for name in unknown:
            if name not in seen:
                seen.add(name)
                pending.append(name)
    return min(lost, key=lambda node: node.index, default=None)


def node_classes(index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]):  # type: ignore[no-untyped-def]
    core = {at for layer in layers for at in layer.internal}
    derived = data_derived(index)
    derived -= indexed_weights(index, shapes, derived)
    core |= relative_scores(index, layers, derived)

    def class_of(node: Node) -> str:
        if node.index in core:
            return "attention"
        if node.op_type in PRODUCT_OPS:
            operands = [name for name in node.inputs[:2] if name]
            from_data = [name in derived for name in operands]
            if any(from_data) and not all(from_data):
                return "projections"
        return "other"

    return class_of


def relative_scores(index: GraphIndex, layers: list[AttentionLayer], derived: set[str]) -> set[int]:
    """The products that score a layer's Q or K against a table computed from weights alone,
    added to its scores (DeBERTa's content-to-position and position-to-content scores): work
    of the attention itself, over every key as the scores are, not a projection of tokens.
    Found back from each layer's masks, up to the first products."""
    found: set[int] = set()
    for layer in layers:
        sides = {layer.q, layer.k, layer.v, layer.gathered_k, layer.gathered_v}
        sides.update(kv_chains(index, derived, [layer]))
        queue = [name for name in layer.masks if name in derived]
        seen = set(queue)
        while queue:
            node = index.producer_of(queue.pop())
            if node is None or node.index in found:
                continue
            data = [name for name in node.inputs if name in derived]
            if node.op_type in PRODUCT_OPS:
                if data and all(name in sides for name in data):
                    found.add(node.index)
                continue
            for name in data:
                if name not in seen and name not in sides:
                    seen.add(name)
                    queue.append(name)
    return found
