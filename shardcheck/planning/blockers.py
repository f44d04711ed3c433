"""What keeps projection and MLP work whole, and the export change that lifts it.

A projection that every rank runs whole reads hidden states that are not scattered. Walking
back from them through position-wise ops, the usual reason is a tensor whose length is read
(a ``Shape`` of it): scattering it would give each rank its local length. What that length
sizes says what to change: positions (a ``Range``: export with ``position_ids`` as a graph
input), a mask (export with the attention mask as a graph input), or another shape.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shardcheck.analysis.axes import AxisMapper, carries_any
from shardcheck.analysis.selections import baked_counts, describe_baked
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.frontier.search import data_derived
from shardcheck.graph.index import Dim, GraphIndex, Node, Shape
from shardcheck.graph.ops import SHAPE_OPS
from shardcheck.planning.flops import indexed_weights

MAX_WALK = 20000  # tensors walked back (a bound: the walk is linear in them)
MAX_SIZED = 400  # tensors followed forward from one Shape
_MASK_OPS = frozenset("Trilu Less LessOrEqual Greater GreaterOrEqual Where".split())


@dataclass(frozen=True)
class Blocker:
    what: str  # "positions are computed from inputs_embeds.shape[1]"
    tensor: str
    node: str  # the Shape node that reads it
    fix: str


def find_blockers(
    index: GraphIndex,
    whole_projections: Iterable[Node],
    sliced: Callable[[str], bool],
    scattered: Iterable[str] = (),
    shape_of: Callable[[str], Shape | None] | None = None,
    sequences: tuple[Dim, ...] = (),
) -> list[Blocker]:
    """The reasons for the projections run whole: each tensor on the way back from them and
    from the tensors scattered after them (``scattered``) whose length sizes positions or a
    mask (else the earliest whose length sizes another shape), the first of each kind in graph
    order. One walk back from all of them, each tensor visited once; none without a
    projection run whole. With ``shape_of`` and the sequence dims ``sequences`` (the model's
    first, an encoder-decoder's decoder length after it), a read of no axis of a sequence
    (``attention_mask.shape[0]``, the batch) blocks nothing and is not named."""
    derived = data_derived(index)
    starts = [
        name for node in whole_projections for name in node.inputs if name and name in derived
    ]
    if not starts:
        return []
    starts += [name for name in scattered if name in derived]
    queue, seen = deque(dict.fromkeys(starts)), set(starts)
    found: list[tuple[int, Blocker]] = []
    while queue and len(seen) < MAX_WALK:
        tensor = queue.popleft()
        if sliced(tensor):
            continue
        for reader in index.consumers_of(tensor):
            if reader.op_type in SHAPE_OPS:
                length, axis = _length_read(index, tensor, reader, shape_of, sequences)
                if length:
                    found.append((reader.index, _blocker(index, tensor, reader, derived, axis)))
        producer = index.producer_of(tensor)
        if producer is None or producer.op_type in SHAPE_OPS:
            continue
        for name in producer.inputs:
            if name and name in derived and name not in seen:
                seen.add(name)
                queue.append(name)
    found.sort(key=lambda item: item[0])
    # The first of each kind: a model's layers repeat the same length reads.
    first: dict[str, Blocker] = {}
    for _, blocker in found:
        first.setdefault(blocker.what.split(" is computed")[0].split(" are computed")[0], blocker)
    telling = [b for b in first.values() if not b.what.startswith("a shape ")]
    seq = sequences[0] if sequences else None
    if not telling and not first and isinstance(seq, int) and shape_of is not None:
        fixed = _spelled_length(index, shape_of, seq)
        return [fixed] if fixed is not None else []
    return telling if telling else list(first.values())[:1]


def unfollowed(
    index: GraphIndex,
    shapes: ShapeInference,
    sequences: tuple[Dim, ...],
    gathered: Iterable[tuple[str, int]],
    whole_projections: Iterable[Node],
    sliced: Callable[[str], bool],
) -> list[Blocker]:
    """Where the sequence is not followed after a tensor gathered on the way to projections
    run whole: the first op in graph order, forward from the ``gathered`` tensors (with their
    axes) through position-wise ops up to the slices (``sliced``: scattered again, or
    computed from a slice), that the axis rules (analysis/axes.py) map no output axis
    of to the input's sequence axis, and that projections run whole are computed from. The
    gather stands before it, and so all that follows runs whole: a mixture of experts' routed
    products (weights picked per token, ``indexed_weights``) are named as the experts."""
    whole = list(whole_projections)
    # A model of fixed length: its head splits spelling the length stop the walk, and
    # ``_spelled_length`` names the first.
    if not whole or not sequences or isinstance(sequences[0], int):
        return []
    derived = data_derived(index)
    feeding = _ancestors(index, whole, derived)
    mapper = AxisMapper(index, shapes, sequences[0], sequences[1:])
    queue, seen = deque(gathered), set()
    stops: set[int] = set()
    while queue and len(seen) < MAX_WALK:
        tensor, axis = queue.popleft()
        if tensor in seen:
            continue
        seen.add(tensor)
        for reader in index.consumers_of(tensor):
            if reader.op_type in SHAPE_OPS:
                continue
            out_axis = mapper.output_axis(reader, tensor, axis)
            if out_axis is not None:
                if not sliced(reader.outputs[0]):
                    queue.append((reader.outputs[0], out_axis))
            elif reader.index in feeding:
                stops.add(reader.index)
    if not stops:
        return []
    stop = index.nodes[min(stops)]
    picked = indexed_weights(index, shapes, derived)
    # The experts are named where the first projection run whole after the stop is one (a stop
    # in an attention layer keeps its own projections whole first, not the experts alone).
    first = _first_reached(index, stop, {node.index for node in whole})
    experts = first is not None and any(name in picked for name in first.inputs)
    # An op computed from a router's TopK is the experts' dispatch (tokens listed or
    # reordered by their experts): the batched form picks each token's experts in place.
    routed = any(index.nodes[at].op_type == "TopK" for at in _ancestors(index, [stop], derived))
    return [
        Blocker(
            ("the experts run whole: " if experts else "")
            + f"the sequence is not followed through {stop.op_type} {stop.label}",
            stop.inputs[0] if stop.inputs else "",
            stop.label,
            _unfollowed_fix(stop, experts and routed),
        )
    ]


def baked_selection(shapes: ShapeInference, whole_projections: Iterable[Node]) -> list[Blocker]:
    """A count of a NonZero that the trace fixed (selections.py), where projections run
    whole: a rank's slice would select its own count, so what the selection feeds cannot run
    on slices (a TorchScript trace's loop over the experts its example hit)."""
    if not any(True for _ in whole_projections):
        return []
    found = baked_counts(shapes)
    if not found:
        return []
    split, _ = found[0]
    what, _, fix = describe_baked(shapes, found).partition("; ")
    return [Blocker(what, split.inputs[0], split.label, fix)]


def unfollowed_back(
    index: GraphIndex,
    shapes: ShapeInference,
    sequences: tuple[Dim, ...],
    scattered: Iterable[tuple[str, int]],
    whole_projections: Iterable[Node],
) -> list[Blocker]:
    """Where the cut stops at an op the axis rules do not follow back: the first in graph
    order of the producers of the ``scattered`` tensors (with their axes) that map no input
    axis to the output's sequence axis, computed from projections run whole. The scatter
    stands after it, and so all before it runs whole (the dynamo exporter's Falcon picked its
    K and V heads by a GatherND that had no rule past its indices)."""
    whole = list(whole_projections)
    if not whole or not sequences or isinstance(sequences[0], int):
        return []
    derived = data_derived(index)
    mapper = AxisMapper(index, shapes, sequences[0], sequences[1:])
    stops = []
    for tensor, axis in scattered:
        producer = index.producer_of(tensor)
        if producer is None or producer.op_type in SHAPE_OPS or tensor not in derived:
            continue
        if mapper.input_axes(producer, axis) is None:
            stops.append(producer)
    whole_at = {node.index for node in whole}
    stops = [stop for stop in stops if whole_at & _ancestors(index, [stop], derived)]
    if not stops:
        return []
    stop = min(stops, key=lambda node: node.index)
    return [
        Blocker(
            f"the sequence is not followed back through {stop.op_type} {stop.label}",
            stop.inputs[0] if stop.inputs else "",
            stop.label,
            _unfollowed_fix(stop, False),
        )
    ]


def _unfollowed_fix(stop: Node, routed_experts: bool) -> str:
    if routed_experts:
        return (
            'export the experts batched (transformers\' experts_implementation="batched_mm"), '
            "whose dispatch is followed token by token"
        )
    if stop.op_type == "ScatterND":
        # TorchScript's copy into part of a new tensor (DeepSeek's K halves) indexes every
        # axis by value, with a grid of Ranges that is followed (analysis/index_grid.py) where
        # it is read; the dynamo exporter's indexes the copied axis only.
        return (
            "its indices address the sequence axis by value, not as a Range over the data's "
            "own length there; the dynamo exporter's copy into part of a tensor addresses the "
            "copied axis alone, which is followed: export with torch.onnx.export(dynamo=True)"
        )
    return (
        "an op that mixes positions keeps what follows it whole; if this one does not, "
        "shardcheck has no rule for it there"
    )


def _first_reached(index: GraphIndex, start: Node, targets: set[int]) -> Node | None:
    """The first of the nodes ``targets`` that a walk forward from ``start``'s outputs
    (breadth first, in the order of each tensor's consumers) reaches."""
    pending, seen = deque(start.outputs), set(start.outputs)
    while pending and len(seen) < MAX_WALK:
        for consumer in index.consumers_of(pending.popleft()):
            if consumer.index in targets:
                return consumer
            for name in consumer.outputs:
                if name and name not in seen:
                    seen.add(name)
                    pending.append(name)
    return None


def _ancestors(index: GraphIndex, nodes: list[Node], derived: set[str]) -> set[int]:
    """The nodes that ``nodes`` are computed from through data (``nodes`` too)."""
    found = {node.index for node in nodes}
    pending = [name for node in nodes for name in node.inputs if name in derived]
    seen = set(pending)
    while pending and len(seen) < MAX_WALK:
        producer = index.producer_of(pending.pop())
        if producer is None or producer.index in found:
            continue
        found.add(producer.index)
        for name in producer.inputs:
            if name in derived and name not in seen:
                seen.add(name)
                pending.append(name)
    return found


def _spelled_length(
    index: GraphIndex, shape_of: Callable[[str], Shape | None], seq: int
) -> Blocker | None:
    """Where a fixed length keeps the cut after the projections: the first head split (a
    Reshape of [.., S, C] to [.., S, H, D]) whose constant target spells the length (dynamo
    DeiT's [-1, 16, 4, 8]): a rank's slice cannot take that target (analysis/axes.py). Only
    head splits, where the axis spelled is the one kept: in a fixed model another axis may
    have the length's size by chance (a patch embedding's channels)."""
    for node in index.nodes:
        if node.op_type != "Reshape" or len(node.inputs) < 2:
            continue
        target = index.constant_ints(node.inputs[1])
        shape = shape_of(node.inputs[0])
        if target is None or not shape or len(target) != len(shape) + 1:
            continue
        kept = range(len(shape) - 1)  # the axes before the one split into heads
        if any(target[axis] == seq and shape[axis] == seq for axis in kept):
            spelled = ", ".join(str(size) for size in target)
            return Blocker(
                f"the length {seq} is spelled in the target of Reshape {node.label} ([{spelled}])",
                node.outputs[0],
                node.label,
                "export with a dynamic sequence axis",
            )
    return None


def _blocker(
    index: GraphIndex, tensor: str, reader: Node, derived: set[str], axis: int | None
) -> Blocker:
    read = f"{tensor}.shape" + ("" if axis is None else f"[{axis}]")
    sized = _what_it_sizes(index, reader, derived)
    if sized == "positions":
        return Blocker(
            f"positions are computed from {read}",
            tensor,
            reader.label,
            "export with position_ids as a graph input",
        )
    if sized == "mask":
        return Blocker(
            f"the attention mask is computed from {read}",
            tensor,
            reader.label,
            "export with the attention mask as a graph input ([batch, 1, S, S])",
        )
    return Blocker(
        f"a shape is computed from {read} (node {reader.label})",
        tensor,
        reader.label,
        "export with that shape as a graph input, or read it from a tensor that is whole",
    )


def _length_read(
    index: GraphIndex,
    tensor: str,
    reader: Node,
    shape_of: Callable[[str], Shape | None] | None,
    sequences: tuple[Dim, ...],
) -> tuple[bool, int | None]:
    """Whether ``reader`` may read a length of ``tensor``, and the axis it reads (None where
    it cannot tell which). Not where the axes it reads are known and none is the sequence: the
    batch of a mask, read to size the positions' batch, blocks no split."""
    axis = _axis_read(index, reader)
    start, end = reader.attr("start"), reader.attr("end")
    known = any(seq is not None for seq in sequences)
    shape = shape_of(tensor) if shape_of is not None and known else None
    if not shape:
        return True, axis if axis is not None or start is None else int(start)
    lengths = [a for a, dim in enumerate(shape) if carries_any(dim, sequences)]
    if axis is not None:
        return axis % len(shape) in lengths, axis
    read = range(len(shape))[slice(start, end)]
    within = [a for a in lengths if a in read]
    return bool(within), within[0] if len(within) == 1 else None


def _axis_read(index: GraphIndex, reader: Node) -> int | None:
    start = reader.attr("start")
    if start is not None and reader.attr("end") == start + 1:
        return int(start)
    for consumer in index.consumers_of(reader.outputs[0]):
        if consumer.op_type == "Gather" and len(consumer.inputs) > 1:
            value = index.constant_value(consumer.inputs[1])
            if value is not None and value.size == 1:
                return int(value.reshape(-1)[0])
    return None


def _what_it_sizes(index: GraphIndex, reader: Node, derived: set[str]) -> str:
    """What the length read sizes, followed through what is computed from shapes and
    constants alone (never into the data a Reshape of it makes): positions (a Range), a mask
    (a Trilu or a comparison), or another shape."""
    queue, seen = deque(reader.outputs[:1]), set(reader.outputs[:1])
    kinds: set[str] = set()
    while queue and len(seen) < MAX_SIZED:
        tensor = queue.popleft()
        for consumer in index.consumers_of(tensor):
            if consumer.op_type == "Range":
                kinds.add("positions")
            elif consumer.op_type in _MASK_OPS:
                kinds.add("mask")
            for name in consumer.outputs:
                if name and name not in seen and name not in derived:
                    seen.add(name)
                    queue.append(name)
    if "positions" in kinds:
        return "positions"
    return "mask" if "mask" in kinds else "shape"
