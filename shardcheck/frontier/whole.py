"""What a round's region forces to be computed whole on every rank.

Each round walks back to a region (see region.py); the rules here find the tensors that must
then be whole, so that the next round's walk stops at them and the cuts move forward: what a
cut is computed from, what is read outside the region, what a whole tensor's Shape sizes,
what is read beside the walk along another axis or by an op mixing positions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.selections import computes_counts
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import mentions
from shardcheck.frontier.kv_readers import (
    KvGathers,
    gathered_for_readers,
    values_for_products,
    weighs_by_probabilities,
)
from shardcheck.frontier.region import Region
from shardcheck.frontier.sliced import SlicedTest
from shardcheck.frontier.sources import ShapeSources, shape_like_ancestors
from shardcheck.frontier.tensor_ids import TensorIds
from shardcheck.graph.index import Dim, GraphIndex, Node
from shardcheck.graph.ops import SHAPE_OPS


def must_be_whole(
    index: GraphIndex,
    ids: TensorIds,
    region: Region,
    forward_nodes: set[int],
    layer_output_flags: bytearray,
    cut_lengths: list[tuple[int, int]] | None = None,
    *,
    lengths_by_reader: bool = False,
) -> set[str]:
    """Region tensors and cuts that a cut tensor is computed from (through data, or a region
    tensor's length via Shape), and data cuts that nodes read outside the region (its nodes,
    and ``forward_nodes``, those after the layers): all must be computed whole.

    ``cut_lengths`` gets each cut whose length a cut is computed from, with the Shape's output
    (as ids): if the former cannot move, no cut is exact (exactness.py).

    ``lengths_by_reader`` (the extension's mode, see lengths.py): a Shape gives each reader
    the length it needs, so a length read never makes a tensor whole."""
    needed: set[str] = set()
    off_walk: list[int] = []
    cut_ids, in_region = region.cut_ids, region.in_region
    sliced = SlicedTest(ids, cut_ids)
    # A cut is computed whole on every rank, so whatever it is computed from must be whole.
    # One walk back from every cut at once (the union is what counts) finds what is not: the
    # region tensors and the cuts it reaches through data, directly or through tensors off the
    # region (Falcon's second layer multiplies its slice by rotary tables its first layer
    # needs whole; the dynamo exports of CodeGen and StableLM compute a cut from another),
    # and the Shape nodes that read a sliced tensor, of the region or computed from it off the
    # walk (BART takes its positions' length from such a tensor). A layer's output ends the
    # walk: what follows a layer reaches a cut through the tensors gathered.
    ends = bytearray(in_region)
    seen = bytearray(len(ids.names))
    for tensor in cut_ids:
        ends[tensor] = 0
        seen[tensor] = 1
    is_cut = bytearray(seen)
    parents, shape_read, names = ids.parents, ids.shape_read, ids.names
    queue = deque(cut_ids)
    pop, append = queue.popleft, queue.append
    while queue:
        current = pop()
        if layer_output_flags[current]:
            continue
        if ends[current]:
            needed.add(names[current])
            continue
        inputs = parents[current]
        if inputs is None:
            read = shape_read[current]
            if read < 0 or lengths_by_reader:  # a graph input or a weight; or a length
                continue
            if sliced(read):
                if is_cut[read] and cut_lengths is not None:
                    cut_lengths.append((read, current))
                if in_region[read]:
                    needed.add(names[read])
                else:
                    off_walk.append(read)
                continue
            # The Shape of a tensor no rank slices: its own shape may come from a sliced one.
            inputs = (read,)
        else:
            for name in inputs:
                if is_cut[name]:
                    needed.add(names[name])
        for name in inputs:
            if not seen[name]:
                seen[name] = 1
                append(name)
    needed |= _region_ancestors(ids, off_walk, in_region)
    consumers, nodes = index.consumers, index.nodes
    region_nodes = region.nodes
    for tensor in region.cut:
        if any(
            user not in region_nodes
            and user not in forward_nodes
            and not _read_for_length(index, nodes[user])
            for user in consumers.get(tensor, ())
        ):
            needed.add(tensor)
    return needed


def _read_for_length(index: GraphIndex, node: Node) -> bool:
    """Whether ``node`` reads its input for a length alone: a Shape, or a node only Shapes
    read (TorchScript's ``k_pe.expand(*k[..., d:].shape)`` slices K for its shape)."""
    if node.op_type in SHAPE_OPS:
        return True
    users = [user for output in node.outputs if output for user in index.consumers_of(output)]
    return bool(users) and all(user.op_type in SHAPE_OPS for user in users)


def sized_whole(
    index: GraphIndex, mapper: AxisMapper, sources: ShapeSources, region: Region
) -> set[str]:
    """Outputs of region nodes sized by the Shape of a whole tensor (an Expand, Reshape or
    Slice whose target is computed from a tensor no rank slices): such an output has the whole
    length, so the cut has to be at it, not before."""
    stops: set[str] = set()
    axes, in_region = region.tensors, region.in_region
    for node_index in region.nodes & sources.sizable:
        output = index.nodes[node_index].outputs[0]
        sized_by = sources.sizing(node_index, axes.get(output, 0), mapper)
        for source in sized_by:
            if not in_region[source]:
                stops.add(output)
                break
    return stops


def sliced_beside(
    index: GraphIndex,
    ids: TensorIds,
    region: Region,
    chains: AbstractSet[str] = frozenset(),
    values: tuple[AxisMapper, AbstractSet[str]] | None = None,
    counts: AbstractSet[str] = frozenset(),
) -> tuple[set[str], KvGathers]:
    """What the region's nodes read broadcast along the axis walked, that a rank would hold a
    slice of (DeBERTa multiplies its mask over the keys, [batch, 1, 1, keys], by the same mask
    turned over the queries, [batch, 1, queries, 1]): sliced along another axis of the node's
    output, it would cut that axis too. It must be whole, and so the region tensors it is
    computed from; but where it is computed from the region through the layers' K and V
    chains (``chains``, the extension's), those are gathered for its readers instead
    (kv_readers.py): the second of the two returned. So is what a MatMul of a layer's
    probabilities weighs along its keys (``values``: the mapper and the probabilities, the
    extension's). A rank's counts of its tokens for each expert (``counts``: selections.py) are
    what its Split of them needs, not a slice."""
    if not region.read_beside:
        return set(), {}
    sliced = SlicedTest(ids, region.cut_ids)
    read = [
        tensor
        for tensor in dict.fromkeys(region.read_beside)
        if ids.names[tensor] not in counts and sliced(tensor)
    ]
    gathers: KvGathers = {}
    if values is not None and read:
        mapper, probabilities = values
        read, gathers = values_for_products(index, ids, mapper, region, sliced, probabilities, read)
    if chains and read:
        read, chain_gathers = gathered_for_readers(index, ids, region, chains, sliced, read)
        gathers.update(chain_gathers)
    return (_region_ancestors(ids, read, region.in_region) if read else set()), gathers


def read_by_mixing(
    index: GraphIndex,
    mapper: AxisMapper,
    region: Region,
    inside_layers: set[int],
    probabilities: AbstractSet[str] | None = None,
    counts: AbstractSet[str] = frozenset(),
) -> tuple[set[str], KvGathers]:
    """Region tensors (other than cuts, but for a Split's input) from which the nodes beside
    the walk compute, through ops that map the axis, an input of an op that mixes positions
    along it (ConvBERT transposes each layer's input and convolves it over the sequence): they
    must be whole.
    What beside the walk only maps the axis (a parallel MLP, say) reads the slice as it is.

    ``probabilities`` (the extension's: what the layers compute inside): a MatMul of those by
    a tensor along its keys is a second value product of a layer, which a rank computes for its
    queries over every key as the layer does. The extension gathers that tensor for it, as the
    layer gathers its V, instead of making it whole (the second of the two returned).

    A reduction across the axis that computes a rank's counts of its tokens for each expert
    (``counts``: selections.py) reads the rank's own positions alone."""
    needed: set[str] = set()
    gathers: dict[str, tuple[int, set[str]]] = {}
    tensors, cut, region_nodes = region.tensors, region.cut, region.nodes

    def beside(node: Node) -> bool:
        return (
            node.index not in region_nodes
            and node.index not in inside_layers
            and node.op_type not in SHAPE_OPS
            and not index.read_for_shape(node)
        )

    # (a node beside the walk, the tensor it reads, that tensor's axis, the region tensor it
    # is computed from). Few nodes are beside the walk: one pass finds those reading it.
    queue = deque(
        (node, name, tensors[name], name)
        for node in index.nodes
        if beside(node)
        for name in node.inputs
        if name in tensors and name not in cut
    )
    seen: set[str] = set()

    def reach(output: str, axis: int, origin: str) -> None:
        """The nodes beside the walk that read ``output``, computed from ``origin``."""
        if not output or output in tensors or output in seen:
            return
        seen.add(output)
        queue.extend(
            (consumer, output, axis, origin)
            for consumer in index.consumers_of(output)
            if beside(consumer)
        )

    # A Split's pieces all carry the axis as its first does. The pieces of a Split of the
    # region that the walk did not reach are read beside it, computed from the Split's input
    # (DiffLlama splits V in two halves: the layer reads one, a second product beside it the
    # other, with the layer's probabilities over every key).
    for at in sorted(region_nodes):
        node = index.nodes[at]
        if node.op_type != "Split" or not node.inputs or node.inputs[0] not in tensors:
            continue
        axis = next((tensors[name] for name in node.outputs if name in tensors), None)
        if axis is not None:
            for output in node.outputs:
                reach(output, axis, node.inputs[0])
    while queue:
        node, tensor, axis, origin = queue.popleft()
        if origin in needed:
            continue
        out_axis = mapper.output_axis(node, tensor, axis)
        if out_axis is None:
            if computes_counts(node, counts):
                continue
            if probabilities is not None and weighs_by_probabilities(
                mapper, node, tensor, axis, probabilities
            ):
                gathers.setdefault(tensor, (axis, set()))[1].add(node.name)
            else:
                needed.add(origin)
            continue
        for output in node.outputs if node.op_type == "Split" else node.outputs[:1]:
            reach(output, out_axis, origin)
    if needed:
        return needed, {}
    return needed, {
        name: (axis, tuple(sorted(readers))) for name, (axis, readers) in gathers.items()
    }


def _region_ancestors(ids: TensorIds, tensors: list[int], in_region: bytearray) -> set[str]:
    """The nearest region tensors that ``tensors`` are computed from (one shared walk)."""
    found: set[str] = set()
    parents = ids.parents
    seen = bytearray(len(ids.names))
    for tensor in tensors:
        seen[tensor] = 1
    queue = deque(tensors)
    while queue:
        current = queue.popleft()
        if in_region[current]:
            found.add(ids.names[current])
            continue
        for name in parents[current] or ():
            if not seen[name]:
                seen[name] = 1
                queue.append(name)
    return found


def sized_by_slices(
    index: GraphIndex,
    shapes: ShapeInference,
    sources: ShapeSources,
    region: Region,
    gathered: dict[str, int],
    whole_when_read: list[int],
) -> set[str]:
    """Region tensors whose length sizes a node after the gathers, which computes whole
    values (TorchScript's T5 reshapes each layer's gathered context with the length of its Q,
    read after Q's head split). In the Polygraphy format a Shape reads what its tensor's other
    consumers read, a rank's slice, where that node needs the whole length: the tensor must
    be whole, so the cut moves past it. ``whole_when_read``: the tensors gathered, and the
    layers' K and V (ids). Where the node's target is known and holds no dim of the tensor's
    sliced axis (a batch or head size), the length is harmless."""
    ids = sources.ids
    sliced = SlicedTest(ids, region.cut_ids, whole=whole_when_read)
    derived, in_region, axes = sources.derived_flags, region.in_region, region.tensors
    needed: set[str] = set()
    for node in _after_gathers(index, region, gathered):
        if node.index not in sources.sizable:
            continue
        data = [ids.id[name] for name in node.inputs if name and derived[ids.id[name]]]
        if any(sliced(tensor) for tensor in data):
            continue  # it computes on a slice itself
        for name in node.inputs:
            if not name or derived[ids.id[name]]:
                continue
            for source in sources.of_id(ids.id[name]):
                source_name = ids.names[source]
                if in_region[source] and _length_reaches(
                    index, shapes, sources, name, source_name, axes[source_name]
                ):
                    needed.add(source_name)
    return needed


def _after_gathers(index: GraphIndex, region: Region, gathered: dict[str, int]) -> list[Node]:
    """The nodes computed from the gathered tensors through data, up to the next cuts."""
    found: list[Node] = []
    seen = set(gathered)
    queue = deque(gathered)
    while queue:
        for node in index.consumers_of(queue.popleft()):
            if node.op_type in SHAPE_OPS or node.index in region.nodes:
                continue
            found.append(node)
            for output in node.outputs:
                if output and output not in seen and output not in region.cut:
                    seen.add(output)
                    queue.append(output)
    return found


def _length_reaches(
    index: GraphIndex,
    shapes: ShapeInference,
    sources: ShapeSources,
    value_of: str,
    tensor: str,
    axis: int,
) -> bool:
    """Whether the shape-like ``value_of`` may hold the length of ``tensor``'s ``axis``, read by
    a Shape of ``tensor``: back from it through shape-like values, leaving those known to hold
    no dim of that length (GPT-2's last Reshape takes its hidden size from the Shape of a
    sliced tensor, and its length from input_ids)."""
    shape = shapes.shape(tensor)
    length = shape[axis] if shape is not None and axis < len(shape) else None

    def free_of_it(current: str) -> bool:
        value = shapes.value(current)
        return length is not None and value is not None and not _holds(value, length)

    return any(
        producer is not None and producer.op_type in SHAPE_OPS and producer.inputs[:1] == (tensor,)
        for _, producer in shape_like_ancestors(index, sources.derived, [value_of], free_of_it)
    )


def _holds(value: tuple[Dim, ...], length: Dim) -> bool:
    """Whether a known shape-like value may hold ``length``: one of its dims is unknown, is
    it, or (a symbol) is computed from it."""
    if isinstance(length, int):
        return any(dim is None or dim == length for dim in value)
    return any(dim is None or mentions(dim, length) for dim in value)
