"""The plan of CP hints for a model, counted: FLOPs on slices, memory, traffic, speed-up.

- the FLOPs on slices and whole, by class, and the bound on speed-up (flop_count.py);
- peak activation memory on one device and on each rank (``activations``);
- the bytes each rank receives per collective and per layer (``traffic``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from shardcheck.analysis.detect import AttentionLayer, detect_attention, sequence_dims
from shardcheck.analysis.elem_types import infer_elem_types
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints
from shardcheck.planning.activations import peak_bytes, tensor_bytes
from shardcheck.planning.blockers import (
    Blocker,
    baked_selection,
    find_blockers,
    unfollowed,
    unfollowed_back,
)
from shardcheck.planning.flop_count import DEFAULT_RANKS, FlopCount, count_with_shapes
from shardcheck.planning.flops import node_flops
from shardcheck.planning.rank_shapes import RankShapes
from shardcheck.planning.traffic import Collective, collectives
from shardcheck.sharding.rewrite import COLLECTIVE_OP


@dataclass(frozen=True)
class LayerPlan:
    """One attention layer as a rank runs it."""

    name: str
    op_type: str
    q_local: bool  # its scores are computed for the rank's queries only
    gathers: tuple[str, ...]  # the roles of its collectives ("gather K", "scatter", ...)
    bytes_received: int | None
    projections_on_slices: float  # share of its span's projection FLOPs run on slices


@dataclass(frozen=True)
class Plan(FlopCount):
    """The FLOPs of the hints (``FlopCount``), with memory, traffic and the layers."""

    peak_bytes_one_device: int
    peak_bytes_per_rank: int
    collectives: tuple[Collective, ...]
    layers: tuple[LayerPlan, ...]
    blockers: tuple[Blocker, ...] = ()
    hints: str = "<hints>"  # where the hints came from (a file, or gen's default)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received or 0 for c in self.collectives)


def make_plan(
    index: GraphIndex,
    hints: ShardHints,
    *,
    seq_len: int | None = None,
    ranks: int = DEFAULT_RANKS,
    dims: Mapping[str, int] | None = None,
    hints_source: str = "<hints>",
    shapes: ShapeInference | None = None,
    layers: list[AttentionLayer] | None = None,
) -> Plan:
    """The plan of ``hints`` on ``index`` at ``seq_len`` (default: DEFAULT_SEQ_LEN, or the
    one length the model runs at) on ``ranks`` ranks (the module docstring says what it
    counts). InputError for settings it cannot count at. ``shapes`` and ``layers``: those of
    ``index``, where the caller has found them (verify), used where the hints name no
    functions to inline first."""
    from shardcheck.sharding.inlined import planned_index

    planned = planned_index(index, hints, hints_source)
    if planned is not index or shapes is None or layers is None:
        shapes = ShapeInference(planned)
        layers = detect_attention(planned, shapes)
    index = planned
    count, found, class_of = count_with_shapes(
        index, hints, seq_len, ranks, dims, hints_source, shapes, layers
    )
    sliced = count.sliced_nodes
    types = _elem_types(found)
    on_rank_size = tensor_bytes(found.on_rank, types)
    on_one_size = _as_computed(index, found, tensor_bytes(found.on_one, types))
    peak_one, _ = peak_bytes(index, index.nodes, on_one_size)
    peak_rank, _ = peak_bytes(found.index, found.index.nodes, on_rank_size)
    for_readers = {gather.name for gather in hints.lengths.for_readers} if hints.lengths else ()
    moved = collectives(found, layers, ranks, on_rank_size, for_readers)
    whole_projections = [
        node for node in index.nodes if class_of(node) == "projections" and node.index not in sliced
    ]
    sliced_tensors = {name for at in sliced for name in index.nodes[at].outputs}
    scattered = [c.tensor for c in moved if c.role == "scatter"]
    sequences = sequence_dims(shapes, layers) if layers else ()
    blockers = find_blockers(
        index, whole_projections, sliced_tensors.__contains__, scattered, shapes.shape, sequences
    )
    blockers += baked_selection(shapes, whole_projections)
    gathered = [(c.tensor, c.axis) for c in moved if c.role == "gather output"]
    resliced = set(scattered).union(sliced_tensors).__contains__
    blockers += unfollowed(index, shapes, sequences, gathered, whole_projections, resliced)
    if not blockers:
        # Else the reasons found explain the cut (a length read sizes a head split that
        # the rules then do not follow back either).
        cut = [(c.tensor, c.axis) for c in moved if c.role == "scatter"]
        blockers += unfollowed_back(index, shapes, sequences, cut, whole_projections)
    return Plan(
        **{part.name: getattr(count, part.name) for part in fields(FlopCount)},
        hints=hints_source,
        peak_bytes_one_device=peak_one,
        peak_bytes_per_rank=peak_rank,
        collectives=tuple(moved),
        layers=tuple(_layer_plans(index, layers, moved, sliced, class_of, found)),
        blockers=tuple(blockers),
    )


def _as_computed(
    index: GraphIndex, found: RankShapes, size: Callable[[str], int | None]
) -> Callable[[str], int | None]:
    """``size`` (of the multi-device model's tensors) asked of the model's own: a tensor that
    only the extension's copies compute there (the original dropped) is the size of the first
    copy's, as the FLOPs count it, so that one device's peak is the same whatever the plan."""
    computed_as = {
        output: again[0].outputs[position]
        for at, again in found.length_copies.items()
        if at not in found.copy_of
        for position, output in enumerate(index.nodes[at].outputs)
        if output and position < len(again[0].outputs)
    }
    if not computed_as:
        return size
    return lambda tensor: size(computed_as.get(tensor, tensor))


def _elem_types(found: RankShapes) -> dict[str, int]:
    index = found.index
    known = {name: t.data_type for name, t in index.initializers.items()}
    for name in index.graph_inputs:
        elem_type = index.elem_type(name)
        if elem_type:
            known[name] = elem_type
    nodes = [node.proto for node in index.nodes]
    return infer_elem_types(nodes, known, same_as_input=COLLECTIVE_OP)


def _layer_plans(
    index: GraphIndex,
    layers: list[AttentionLayer],
    moved: list[Collective],
    sliced: set[int],
    class_of,  # type: ignore[no-untyped-def]
    found: RankShapes,
) -> list[LayerPlan]:
    # A layer's span: the nodes after the previous layer's output, to its own output (its
    # projections and MLP before its attention, as a transformer's block computes them).
    ends = [index.producer.get(layer.output, len(index.nodes) - 1) for layer in layers]
    plans = []
    for position, layer in enumerate(layers):
        start = ends[position - 1] + 1 if position else 0
        on, total = 0, 0
        for node in index.nodes[start : ends[position] + 1]:
            if class_of(node) != "projections":
                continue
            copy = found.copy_of.get(node.index)
            flops = (node_flops(found.on_one, copy) or 0) if copy is not None else 0
            total += flops
            on += flops if node.index in sliced else 0
        own = [c for c in moved if c.layer == position]
        received = [c.bytes_received for c in own]
        plans.append(
            LayerPlan(
                name=layer.name,
                op_type=layer.op_type,
                q_local=min(layer.internal, default=-1) in sliced,
                gathers=tuple(c.role for c in own),
                bytes_received=None if None in received else sum(received),  # type: ignore[arg-type]
                projections_on_slices=on / total if total else 0.0,
            )
        )
    return plans
