"""Which tensors to scatter and gather: the CP frontier.

Everything a rank computes on its slice of the sequence (the sharded region) is found by walking
back from the attention layers' Q, K and V (and the query side of their masks) through
position-wise ops. The walk stops where CP can no longer cut: at a graph input; at a tensor that
is computed from shapes and constants alone (position ids, position tables, causal masks: these
are computed whole on every rank and scattered); at an op that mixes positions. Those tensors
are the inputs to scatter. A data tensor whose other consumers are outside the region moves
forward to its consumers in the region, so that nothing outside sees a slice; a ``Shape`` of it
that sizes the position tables or masks counts as such a consumer.

Forward from the attention outputs, the region ends at graph outputs and before ops that mix
positions (pooling, a classification head): the tensors to gather. Every walk visits each
tensor once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer, reaches_range, sequence_dim
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import always_one, mentions
from shardcheck.graph.index import SHAPE_OPS, Dim, GraphIndex, Node
from shardcheck.graph.tensor_ids import TensorIds


@dataclass(frozen=True)
class CutTensor:
    name: str
    axis: int
    rank: int | None


@dataclass
class Frontier:
    inputs: list[CutTensor] = field(default_factory=list)
    outputs: list[CutTensor] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def data_derived(index: GraphIndex) -> set[str]:
    """Tensors whose values depend on the data of a graph input (not only on its shape)."""
    derived = set(index.graph_inputs)
    for node in index.nodes:
        # "" (an omitted optional input or output) is never kept in the set, so isdisjoint
        # needs no filter.
        if node.op_type in SHAPE_OPS or derived.isdisjoint(node.inputs):
            continue
        derived.update(node.outputs)
        derived.discard("")
    return derived


MAX_ROUNDS = 12


def _packed(layer: AttentionLayer) -> bool:
    """Whether the layer computes Q, K and V from one input (gathering K gathers Q)."""
    return layer.q == layer.gathered_k


def _gathered_kv(layers: list[AttentionLayer]) -> set[str]:
    """The K and V the layers gather: whole on every rank when read."""
    return {name for layer in layers for name in (layer.gathered_k, layer.gathered_v)}


def find_frontier(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> Frontier:
    result = Frontier()
    if not layers:
        return result
    seq = sequence_dim(shapes, layers)
    mapper = AxisMapper(index, shapes, seq)
    derived = data_derived(index)
    seeds = list(_seeds(index, shapes, mapper, layers))

    # Tensors that must be computed whole on every rank. A cut next to one of them moves to
    # its consumers; rounds repeat until nothing new must be whole (each round moves forward).
    # A layer computing Q, K and V from one input (a packed com.microsoft Attention) gets that
    # input gathered as its K and V, and so its Q: its output is whole on every rank.
    whole: set[str] = {layer.output for layer in layers if _packed(layer)}
    layer_outputs = {layer.output: layer for layer in layers if not _packed(layer)}
    # This first walk only gives the nodes after the layers; the last one, once the region is
    # known, gives the tensors to gather and the warnings.
    _, forward_nodes = _walk_forward(index, mapper, layers, Frontier())
    ids = TensorIds(index)
    layer_output_flags = ids.flags(layer_outputs)
    inside_layers = {node for layer in layers for node in layer.internal}
    # What the layers compute inside (their scores): sliced along the queries.
    layers_own = {output for at in inside_layers for output in index.nodes[at].outputs}
    sources = _ShapeSources(index, ids, derived)
    back = _BackWalk(index, mapper, ids, sources.derived_flags, layer_outputs)
    for _ in range(MAX_ROUNDS):
        walked = back.walk(seeds, whole)
        region, cut = walked.tensors, walked.cut
        cut_lengths: list[tuple[int, int]] = []
        needed = _must_be_whole(index, ids, walked, forward_nodes, layer_output_flags, cut_lengths)
        needed |= _sized_whole(index, mapper, sources, walked)
        needed |= _sliced_beside(ids, walked)
        needed -= whole
        masks = _whole_sized_masks(
            index, shapes, mapper, sources, layers, (region, layers_own), seeds
        )
        if not needed and not masks:
            # Checked last, once the rest holds (it reads every node): a region tensor read
            # by an op that mixes positions along its axis, beside the walk.
            needed = _read_by_mixing(index, mapper, walked, inside_layers) - whole
            if not needed:
                break
        whole |= needed
        seeds.extend(masks)
    order = _GraphOrder(index)
    result.inputs = _ordered(order, shapes, cut)
    # Again, now that the region is known: a position-wise op sized by a whole tensor's Shape
    # (a Reshape back to [batch, sequence, hidden] with the length of an unsliced input) gets
    # the gathered tensor.
    gathered = _gathered(
        index, mapper, layers, result, sources, set(region), walked.cut_ids, inside_layers
    )
    result.outputs = _ordered(order, shapes, gathered)
    _check_cuts(index, layers, cut, gathered, result)
    region_names = set(region)
    _check_layer_insides(index, layers, sources, region_names, cut, result)
    _check_key_lengths(index, shapes, mapper, layers, sources, region_names, result)
    _check_cut_lengths(index, shapes, layers, ids, walked, cut_lengths, seq, result)
    return result


def _gathered(
    index: GraphIndex,
    mapper: AxisMapper,
    layers: list[AttentionLayer],
    result: Frontier,
    sources: _ShapeSources,
    region: set[str],
    cut: list[int],
    inside_layers: set[int],
) -> dict[str, int]:
    """The tensors to gather (with their axes), and the warnings of the walk forward.

    A node that also reads a tensor every rank holds whole gets the gathered tensor. Which
    tensors those are depends on the gathers (what follows one is whole), so the walk takes
    every other input it reads for a slice; an input it did not reach that is computed from
    no slice once its gathers are known (and those of the layers' K and V) forces the node to
    take the gathered tensor, and the walk repeats until no more nodes are forced."""
    ids = sources.ids
    kv = [ids.id[name] for name in _gathered_kv(layers)]
    forced: set[int] = set()
    for _ in range(MAX_ROUNDS):
        reads_whole = _WholeReads(sources.derived, forced, inside_layers)
        walk = Frontier()
        gathered, _ = _walk_forward(index, mapper, layers, walk, sources, region, reads_whole)
        reached = reads_whole.reached
        unsettled = [(node, name) for node, name in reads_whole.pending if name not in reached]
        if not unsettled:
            break
        sliced = _SlicedTest(ids, cut, whole=[*kv, *(ids.id[name] for name in gathered)])
        more = {node for node, name in unsettled if not sliced(ids.id[name])}
        if more <= forced:
            break
        forced |= more
    result.warnings.extend(walk.warnings)
    return gathered


def _check_cut_lengths(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    ids: TensorIds,
    region: _Region,
    cut_lengths: list[tuple[int, int]],
    seq: Dim | None,
    result: Frontier,
) -> None:
    """A cut is computed whole on every rank, then scattered; one computed from the length of
    another cut reads it after the scatter: a slice's length, where it needs the whole one.
    That cut cannot move forward when it is the query side of a layer (TorchScript's GPT-Neo
    slices its causal mask from row ``len(K) - len(Q)``), so no exact cut is left. The gathered
    K and V are whole when read, and a length that the sequence does not reach (a batch or a
    head size) is harmless."""
    gathered = _gathered_kv(layers)
    warned: set[int] = set()
    for read, shape_output in sorted(set(cut_lengths)):
        if read in warned or ids.names[read] in gathered:
            continue
        sized = _cut_sized_by(index, shapes, region, ids.names[shape_output], seq)
        if sized is None:
            continue
        warned.add(read)
        shape_node = index.nodes[ids.producer[shape_output]]
        result.warnings.append(
            f"no exact cut at {sized}: it is computed whole and scattered, but "
            f"{shape_node.label} gives it the length of {ids.names[read]}, which each rank "
            "holds a slice of; CP may not be exact"
        )


def _cut_sized_by(
    index: GraphIndex, shapes: ShapeInference, region: _Region, length: str, seq: Dim | None
) -> str | None:
    """The first cut that ``length`` (a Shape's output) sizes along a path the sequence length
    may take: forward through tensors off the region, leaving those whose value is known and
    holds no ``seq``."""
    cut, tensors = region.cut, region.tensors
    queue = deque([length])
    seen = {length}
    while queue:
        tensor = queue.popleft()
        for consumer in index.consumers_of(tensor):
            for output in consumer.outputs:
                if not output or output in seen:
                    continue
                seen.add(output)
                if output in cut:
                    return output
                if output in tensors or _without_sequence(shapes.value(output), seq):
                    continue
                queue.append(output)
    return None


def _without_sequence(value: tuple[Dim, ...] | None, seq: Dim | None) -> bool:
    """Whether a shape-like value is known and none of its dims is, or is computed from, the
    sequence length ``seq``."""
    if value is None or not isinstance(seq, str):
        return False
    return all(dim is not None and not mentions(dim, seq) for dim in value)


def _check_layer_insides(
    index: GraphIndex,
    layers: list[AttentionLayer],
    sources: _ShapeSources,
    region: set[str],
    cut: dict[str, int],
    result: Frontier,
) -> None:
    """Inside a layer (between its score and context MatMuls) nothing can be cut: a node there
    sized by the Shape of a tensor off the region gets the wrong length next to the scores:
    the whole one for a tensor the cuts leave whole (Bloom reshapes its scores with such a
    length), a slice's for one computed from a slice off the walk (MPT slices its ALiBi bias to
    the length of a transposed copy of K, before K is gathered)."""
    sliced = _SlicedTest(sources.ids, [sources.ids.id[name] for name in cut])
    for layer in layers:
        for node_index in layer.internal:
            node = index.nodes[node_index]
            source = (
                None
                if node.op_type in SHAPE_OPS
                else _size_source_off_region(node, sources, region)
            )
            if source is None:
                continue
            held = (
                "each rank holds a slice of"
                if sliced(sources.ids.id[source])
                else "every rank holds whole"
            )
            result.warnings.append(
                f"no exact cut inside layer {layer.name}: {node.label} is sized by the length "
                f"of {source}, which {held}; CP may not be exact"
            )
            break


def _check_key_lengths(
    index: GraphIndex,
    shapes: ShapeInference,
    mapper: AxisMapper,
    layers: list[AttentionLayer],
    sources: _ShapeSources,
    region: set[str],
    result: Frontier,
) -> None:
    """Inside a layer the keys are whole (K and V are gathered): a node there sized along the
    key axis (the last) by the Shape of K or V before the gather, which ranks hold slices of
    (``region``), gets each rank's local length instead (BART-style exports reshape the
    scores with the length of K's own reshape)."""
    id_of, names = sources.ids.id, sources.ids.names
    for layer in layers:
        before_gather = {
            id_of[name]
            for k_or_v, gathered in ((layer.k, layer.gathered_k), (layer.v, layer.gathered_v))
            for name in _layout_chain(index, sources.derived, k_or_v, gathered)
            if name in region
        }
        for node_index in layer.internal:
            node = index.nodes[node_index]
            rank = shapes.rank(node.outputs[0]) if node.outputs else None
            if node_index not in sources.sizable or not rank:
                continue
            sized_by = sources.sizing(node_index, rank - 1, mapper) & before_gather
            if sized_by:
                result.warnings.append(
                    f"no exact cut inside layer {layer.name}: {node.label} is sized along the "
                    f"keys by the length of {names[min(sized_by)]}, which each rank holds a "
                    "slice of before K and V are gathered; CP may not be exact"
                )
                break


def _layout_chain(index: GraphIndex, derived: set[str], start: str, end: str) -> list[str]:
    """The tensors from ``start`` (K or V) up to ``end`` (what CP gathers), without it: back
    from ``end`` through each producer's data input."""
    chain: list[str] = []
    current = end
    for _ in range(32):
        producer = index.producer_of(current)
        if current == start or producer is None:
            break
        data = [name for name in producer.inputs if name in derived]
        if not data:
            break
        current = data[0]
        chain.append(current)
    return chain


def _check_cuts(
    index: GraphIndex,
    layers: list[AttentionLayer],
    cut: dict[str, int],
    gathered: dict[str, int],
    result: Frontier,
) -> None:
    """Follow what each rank holds in slices, from the scattered tensors to the gathered ones;
    a scattered tensor computed from a slice means no cut makes CP exact there."""
    whole_when_read = set(gathered) | _gathered_kv(layers)
    sliced = set(cut)
    for node in index.nodes:
        if node.op_type in SHAPE_OPS or sliced.isdisjoint(node.inputs):
            continue
        reads = [name for name in node.inputs if name in sliced and name not in whole_when_read]
        if not reads:
            continue
        for output in node.outputs:
            if output in cut:
                result.warnings.append(
                    f"no exact cut at {output}: it is scattered, but {node.label} computes it "
                    f"from {reads[0]}, which each rank holds a slice of; CP may not be exact"
                )
            elif output:
                sliced.add(output)


class _ShapeSources:
    """For a shape-like tensor (computed from shapes and constants), the tensors whose Shape
    it is computed from. Memoised, so the whole analysis stays linear; on tensor ids (see
    TensorIds), by name for the few questions asked by name."""

    def __init__(self, index: GraphIndex, ids: TensorIds, derived: set[str]) -> None:
        self.index = index
        self.ids = ids
        self.derived = derived
        self.derived_flags = ids.flags(derived)
        self._memo: list[frozenset[int] | None] = [None] * len(ids.names)
        self.sizing_memo: dict[tuple[int, int], frozenset[int]] = {}
        # The nodes with an input computed from some tensor's Shape (one whose ``of`` is not
        # empty): only these can be sized by one. Most nodes have none (their other inputs are
        # weights and constants); every round skips them at once. One pass in graph order.
        from_shapes: set[str] = set()
        self.sizable: set[int] = set()
        for node in index.nodes:
            if node.op_type in SHAPE_OPS:
                from_shapes.update(node.outputs)
            elif not from_shapes.isdisjoint(node.inputs) and any(
                name in from_shapes and name not in derived for name in node.inputs
            ):
                self.sizable.add(node.index)
                from_shapes.update(node.outputs)
            else:
                continue
            from_shapes.discard("")

    def of(self, tensor: str) -> frozenset[str]:
        names = self.ids.names
        return frozenset(names[source] for source in self.of_id(self.ids.id[tensor]))

    def of_id(self, tensor: int) -> frozenset[int]:
        memo = self._memo
        known = memo[tensor]
        if known is not None:
            return known
        memo[tensor] = _NO_SOURCES  # guards against cycles in malformed graphs
        read = self.ids.shape_read[tensor]
        if read >= 0:
            result = frozenset((read,))
        else:
            found: set[int] = set()
            derived = self.derived_flags
            for name in self.ids.parents[tensor] or ():
                if not derived[name]:
                    sources = memo[name]
                    found |= self.of_id(name) if sources is None else sources
            result = frozenset(found)
        memo[tensor] = result
        return result

    def sizing(self, node_index: int, axis: int, mapper: AxisMapper) -> frozenset[int]:
        """The tensors whose Shape sizes ``node``'s output along ``axis``: the sources of its
        shape-like inputs other than those the axis comes from. The same in every round."""
        key = (node_index, axis)
        found = self.sizing_memo.get(key)
        if found is None:
            node = self.index.nodes[node_index]
            initializers = self.index.initializers
            # Weights and constants are sized by nothing: most inputs end here.
            shape_like = [
                name
                for name in node.inputs
                if name and name not in self.derived and name not in initializers
            ]
            if shape_like:
                mapped = mapper.input_axes(node, axis) or []
                followed = {name for name, _ in mapped}
                id_of, of = self.ids.id, self.of_id
                found = frozenset(
                    source
                    for name in shape_like
                    if name not in followed
                    for source in of(id_of[name])
                )
            else:
                found = _NO_SOURCES
            self.sizing_memo[key] = found
        return found


_NO_SOURCES: frozenset[int] = frozenset()


def _sized_whole(
    index: GraphIndex, mapper: AxisMapper, sources: _ShapeSources, region: _Region
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


def _sized_by_whole(
    node: Node, sources: _ShapeSources, region: set[str], reached: set[str]
) -> bool:
    """Whether a shape-like input of ``node`` comes from the Shape of a tensor that no rank
    slices (in neither ``region`` nor ``reached``)."""
    return _size_source_off_region(node, sources, region, reached) is not None


def _size_source_off_region(
    node: Node,
    sources: _ShapeSources,
    region: set[str],
    reached: frozenset[str] | set[str] = frozenset(),
) -> str | None:
    """The first tensor outside ``region`` and ``reached`` whose Shape a shape-like input of
    ``node`` is computed from, if any."""
    for name in node.inputs:
        # An input that is itself sliced (scattered, or computed from a slice) is no size.
        if name and name not in sources.derived and name not in region and name not in reached:
            for source in sorted(sources.of(name)):
                if source not in region and source not in reached:
                    return source
    return None


def _seeds(
    index: GraphIndex, shapes: ShapeInference, mapper: AxisMapper, layers: list[AttentionLayer]
) -> Iterable[tuple[str, int]]:
    for layer in layers:
        for tensor, axis in (
            (layer.q, layer.q_axis),
            (layer.gathered_k, layer.k_axis),
            (layer.gathered_v, layer.v_axis),
        ):
            if axis is not None:
                yield tensor, axis
        for mask in layer.masks:
            mask_shape = shapes.shape(mask)
            if mask_shape is None or len(mask_shape) < 2 or always_one(mask_shape[-2]):
                continue
            # The mask broadcasts against the scores [..., query, key]. A causal mask differs
            # from row to row: each rank needs its rows. A padding mask only broadcast along
            # the query axis is computed locally as it stands.
            axis = len(mask_shape) - 2
            if layer.causal is not None or _axis_ends(index, mapper, mask, axis)[1]:
                yield mask, axis


def _whole_sized_masks(
    index: GraphIndex,
    shapes: ShapeInference,
    mapper: AxisMapper,
    sources: _ShapeSources,
    layers: list[AttentionLayer],
    sliced: tuple[dict[str, int], set[str]],
    seeds: list[tuple[str, int]],
) -> list[tuple[str, int]]:
    """Masks left unscattered whose query axis is sized by a whole tensor's Shape (e.g. a
    Range over the length of an unsliced input): on a rank they would keep the whole query
    length next to sliced scores, so they are scattered along it. ``sliced``: the region's
    tensors, and the layers' own (their scores, sliced along the queries: a mask expanded to
    the scores' shape is local, as TorchScript's XLM makes it)."""
    region, layers_own = sliced
    seeded = {tensor for tensor, _ in seeds}
    found: list[tuple[str, int]] = []
    for layer in layers:
        for mask in layer.masks:
            shape = shapes.shape(mask)
            if mask in seeded or shape is None or len(shape) < 2 or always_one(shape[-2]):
                continue
            axis = len(shape) - 2
            for origin in _axis_ends(index, mapper, mask, axis)[0]:
                producer = index.producer_of(origin)
                inputs = [origin] if producer is None else [n for n in producer.inputs if n]
                sized_by = {
                    s for name in inputs if name not in sources.derived for s in sources.of(name)
                }
                positional = producer is not None and _relative_position(index, producer)
                if positional or any(
                    source not in region and source not in layers_own for source in sized_by
                ):
                    found.append((mask, axis))
                    seeded.add(mask)
                    break
    return found


RELATING_OPS = frozenset("Sub Add Less LessOrEqual Greater GreaterOrEqual Equal".split())


def _relative_position(index: GraphIndex, node: Node, depth: int = 8) -> bool:
    """Whether the positions a Range makes are combined with another Range's (relative
    positions, as T5's bias buckets): a mask built so differs from row to row. Comparing them
    with constants (BERT's in-range test) does not."""
    if node.op_type != "Range":
        return False
    frontier = [node.outputs[0]]
    for _ in range(depth):
        following: list[str] = []
        for tensor in frontier:
            for consumer in index.consumers_of(tensor):
                if consumer.op_type in RELATING_OPS:
                    others = [name for name in consumer.inputs[:2] if name and name != tensor]
                    if any(reaches_range(index, name, excluding=node) for name in others):
                        return True
                following.extend(name for name in consumer.outputs if name)
        frontier = following[:32]
    return False


def _axis_ends(
    index: GraphIndex, mapper: AxisMapper, tensor: str, axis: int
) -> tuple[list[str], bool]:
    """Where an axis begins, followed back through position-wise ops on every path: the
    tensors that create it, and whether some path reaches a graph input's own axis."""
    origins: list[str] = []
    from_input = False
    queue = deque([(tensor, axis)])
    seen: set[tuple[str, int]] = set()
    while queue:
        current = queue.popleft()
        if current in seen:
            continue
        seen.add(current)
        producer = index.producer_of(current[0])
        if producer is None:
            if current[0] in index.input_infos:
                from_input = True
            else:
                origins.append(current[0])
            continue
        mapped = mapper.input_axes(producer, current[1])
        if mapped:
            queue.extend(mapped)
        else:
            origins.append(current[0])
    return origins, from_input


# The mapper's answer not asked yet (None is an answer: the op mixes positions).
_NOT_ASKED: list[tuple[int, int]] = []


class _BackWalk:
    """The region of a round: everything walked back from the seeds through position-wise
    ops, with the axis each tensor carries, the nodes computing it, and where the walk
    stopped (the cuts). It runs on tensor ids (see TensorIds); the mapper's answers, as ids,
    are kept for the later rounds."""

    def __init__(
        self,
        index: GraphIndex,
        mapper: AxisMapper,
        ids: TensorIds,
        derived: bytearray,
        layer_outputs: dict[str, AttentionLayer],
    ) -> None:
        self.index = index
        self.mapper = mapper
        self.ids = ids
        self.derived = derived  # flags by tensor id
        self.layer_outputs = {ids.id[name]: layer for name, layer in layer_outputs.items()}
        self.mapped: dict[tuple[int, int], list[tuple[int, int]] | None] = {}
        # What the node reads beside the mapped inputs (broadcast along the axis walked),
        # computed from data: each rank reads it as it holds it.
        self.beside: dict[tuple[int, int], tuple[int, ...]] = {}

    def walk(self, seeds: list[tuple[str, int]], whole: set[str]) -> _Region:
        ids = self.ids
        id_of, names = ids.id, ids.names
        whole_flags = ids.flags(whole)
        region: dict[int, int] = {}
        region_nodes: set[int] = set()
        cut: dict[int, int] = {}
        queue = deque([(id_of[name], axis) for name, axis in seeds])
        pop, extend = queue.popleft, queue.extend
        producers, nodes, derived = ids.producer, self.index.nodes, self.derived
        layer_outputs, known, beside_known = self.layer_outputs, self.mapped, self.beside
        input_axes = self.mapper.input_axes
        parents = ids.parents
        read_beside: list[int] = []
        while queue:
            tensor, axis = pop()
            if tensor in region:
                continue
            region[tensor] = axis
            layer = layer_outputs.get(tensor)
            if layer is not None:
                # An earlier layer: its inside is sliced along the query axis and its Q, K, V
                # and masks are seeds of their own.
                region_nodes.update(layer.internal)
                continue
            producer_index = producers[tensor]
            if producer_index < 0 or not derived[tensor] or whole_flags[tensor]:
                cut[tensor] = axis
                continue
            key = (producer_index, axis)
            mapped = known.get(key, _NOT_ASKED)
            if mapped is _NOT_ASKED:
                producer = nodes[producer_index]
                found = None if producer.op_type == "Constant" else input_axes(producer, axis)
                mapped = known[key] = (
                    None if found is None else [(id_of[name], at) for name, at in found]
                )
                if mapped is not None:
                    along = {name for name, _ in mapped}
                    unmapped = tuple(
                        name
                        for name in parents[tensor] or ()
                        if derived[name] and name not in along
                    )
                    if unmapped:
                        beside_known[key] = unmapped
            if mapped is not None:
                for name, _ in mapped:
                    if whole_flags[name]:
                        break
                else:
                    region_nodes.add(producer_index)
                    extend(mapped)
                    if key in beside_known:
                        read_beside.extend(beside_known[key])
                    continue
            cut[tensor] = axis
        in_region = bytearray(len(names))
        for tensor in region:
            in_region[tensor] = 1
        return _Region(
            {names[tensor]: axis for tensor, axis in region.items()},
            region_nodes,
            {names[tensor]: axis for tensor, axis in cut.items()},
            in_region,
            list(cut),
            read_beside,
        )


@dataclass(frozen=True)
class _Region:
    """What a round's walk back reached: the tensors (with the axis each carries), the
    nodes computing them, and the cuts; the tensors and cuts as ids too. ``read_beside``:
    the data tensors its nodes read broadcast along the axis walked (ids)."""

    tensors: dict[str, int]
    nodes: set[int]
    cut: dict[str, int]
    in_region: bytearray  # by tensor id
    cut_ids: list[int]
    read_beside: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls, ids: TensorIds, tensors: dict[str, int], nodes: set[int], cut: dict[str, int]
    ) -> _Region:
        return cls(tensors, nodes, cut, ids.flags(tensors), [ids.id[name] for name in cut])


def _must_be_whole(
    index: GraphIndex,
    ids: TensorIds,
    region: _Region,
    forward_nodes: set[int],
    layer_output_flags: bytearray,
    cut_lengths: list[tuple[int, int]] | None = None,
) -> set[str]:
    """Region tensors and cuts that a cut tensor is computed from (through data, or a region
    tensor's length via Shape), and data cuts that nodes read outside the region (its nodes,
    and ``forward_nodes``, those after the layers): all must be computed whole.

    ``cut_lengths`` gets each cut whose length a cut is computed from, with the Shape's output
    (as ids): if the former cannot move, no cut is exact (_check_cut_lengths)."""
    needed: set[str] = set()
    off_walk: list[int] = []
    cut_ids, in_region = region.cut_ids, region.in_region
    sliced = _SlicedTest(ids, cut_ids)
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
            if read < 0:  # a graph input or a weight
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
            and nodes[user].op_type not in SHAPE_OPS
            for user in consumers.get(tensor, ())
        ):
            needed.add(tensor)
    return needed


def _sliced_beside(ids: TensorIds, region: _Region) -> set[str]:
    """What the region's nodes read broadcast along the axis walked, that a rank would hold a
    slice of (DeBERTa multiplies its mask over the keys, [batch, 1, 1, keys], by the same mask
    turned over the queries, [batch, 1, queries, 1]): sliced along another axis of the node's
    output, it would cut that axis too. It must be whole, and so the region tensors it is
    computed from."""
    if not region.read_beside:
        return set()
    sliced = _SlicedTest(ids, region.cut_ids)
    read = [tensor for tensor in dict.fromkeys(region.read_beside) if sliced(tensor)]
    return _region_ancestors(ids, read, region.in_region) if read else set()


def _read_by_mixing(
    index: GraphIndex,
    mapper: AxisMapper,
    region: _Region,
    inside_layers: set[int],
) -> set[str]:
    """Region tensors (other than cuts) from which the nodes beside the walk compute, through
    ops that map the axis, an input of an op that mixes positions along it (ConvBERT
    transposes each layer's input and convolves it over the sequence): they must be whole.
    What beside the walk only maps the axis (a parallel MLP, say) reads the slice as it is."""
    needed: set[str] = set()
    tensors, cut, region_nodes = region.tensors, region.cut, region.nodes

    def beside(node: Node) -> bool:
        return (
            node.index not in region_nodes
            and node.index not in inside_layers
            and node.op_type not in SHAPE_OPS
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
    while queue:
        node, tensor, axis, origin = queue.popleft()
        if origin in needed:
            continue
        out_axis = mapper.output_axis(node, tensor, axis)
        if out_axis is None:
            needed.add(origin)
            continue
        output = node.outputs[0]
        if not output or output in tensors or output in seen:
            continue
        seen.add(output)
        queue.extend(
            (consumer, output, out_axis, origin)
            for consumer in index.consumers_of(output)
            if beside(consumer)
        )
    return needed


# The sliced test's answers, by tensor id (0: not known yet).
_WHOLE, _SLICED = 1, 2


class _SlicedTest:
    """Whether a tensor is computed from a scattered one through data (what a rank holds a
    slice of, or derived from a slice). Asked of few tensors, so answered walking back from
    them, memoised, rather than by following every cut forward through the whole graph."""

    def __init__(self, ids: TensorIds, cut: Iterable[int], whole: Iterable[int] = ()) -> None:
        self.parents = ids.parents
        self.memo = bytearray(len(ids.names))
        # ``whole``: what each rank holds whole although computed from a slice (a gathered
        # tensor); what is computed from it alone is whole too.
        for tensor in whole:
            self.memo[tensor] = _WHOLE
        for tensor in cut:
            self.memo[tensor] = _SLICED

    def __call__(self, tensor: int) -> bool:
        memo = self.memo
        if memo[tensor]:
            return memo[tensor] == _SLICED
        parents = self.parents
        # Depth first with an explicit stack (data paths are thousands of nodes long). A
        # tensor waits on the first of its inputs not yet known; ``expanding`` holds the
        # tensors waiting, so that a cycle in a malformed graph ends instead of looping.
        stack = [tensor]
        expanding: set[int] = set()
        while stack:
            current = stack[-1]
            if memo[current]:
                stack.pop()
                continue
            inputs = parents[current]
            if inputs is None:  # a graph input, a weight, or a Shape's output
                memo[current] = _WHOLE
                stack.pop()
                continue
            sliced = False
            waiting = None
            for name in inputs:
                value = memo[name]
                if value == _SLICED:
                    sliced = True
                    break
                if not value and waiting is None and name not in expanding:
                    waiting = name
            if sliced or waiting is None:
                memo[current] = _SLICED if sliced else _WHOLE
                expanding.discard(current)
                stack.pop()
            else:
                expanding.add(current)
                stack.append(waiting)
        return memo[tensor] == _SLICED


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


def _walk_forward(
    index: GraphIndex,
    mapper: AxisMapper,
    layers: list[AttentionLayer],
    result: Frontier,
    sources: _ShapeSources | None = None,
    region: set[str] | None = None,
    reads_whole: _WholeReads | None = None,
) -> tuple[dict[str, int], set[int]]:
    """The tensors to gather, and the position-wise nodes after the attention layers.

    With ``reads_whole``, a node that also reads a tensor every rank holds whole along the
    same axis (data, not a broadcast) gets the gathered tensor: ConvBERT concatenates each
    layer's attention heads with its convolution heads, computed whole."""
    barriers = _gathered_kv(layers)
    outputs: dict[str, int] = {}
    queue: deque[tuple[str, int]] = deque()
    for layer in layers:
        if layer.q_axis is not None and not _packed(layer):
            rank = mapper.shapes.rank(layer.output)
            if rank is not None:
                axis = layer.output_axis
                queue.append((layer.output, rank - 2 if axis is None else axis))
    seen: set[str] = set() if reads_whole is None else reads_whole.reached
    # The tensor and axis each tensor was first reached from: a gather along a merged axis
    # moves up to where the axis was whole (see _unmerged).
    came_from: dict[str, tuple[str, int]] = {}
    nodes: set[int] = set()
    graph_outputs = set(index.graph_outputs)
    consumers = index.consumers
    all_nodes = index.nodes
    output_axis = mapper.output_axis
    # Only a node with an input computed from a Shape can be sized by a whole tensor.
    sizable = sources.sizable if sources is not None and region is not None else frozenset()
    while queue:
        tensor, axis = queue.popleft()
        if tensor in seen or tensor in barriers:
            continue
        seen.add(tensor)
        if tensor in graph_outputs:
            outputs[tensor] = axis
        mixing = []
        users = 0
        for consumer_index in consumers.get(tensor, ()):
            consumer = all_nodes[consumer_index]
            if consumer.op_type in SHAPE_OPS:
                continue
            users += 1
            out_axis = output_axis(consumer, tensor, axis)
            if out_axis is not None and (
                (
                    consumer_index in sizable and _sized_by_whole(consumer, sources, region, seen)  # type: ignore[arg-type]
                )
                or (
                    reads_whole is not None
                    and reads_whole(consumer, tensor, out_axis, mapper, region)  # type: ignore[arg-type]
                )
            ):
                out_axis = None
            if out_axis is None:
                mixing.append(consumer)
            else:
                nodes.add(consumer_index)
                queue.append((consumer.outputs[0], out_axis))
                came_from.setdefault(consumer.outputs[0], (tensor, axis))
        if mixing and tensor not in graph_outputs:
            outputs[tensor] = axis
        if tensor in outputs and len(mixing) != users:
            why = "a graph output" if tensor in graph_outputs else f"read by {mixing[0].label}"
            result.warnings.append(
                f"{tensor} is gathered ({why}) but also feeds position-wise ops, which would "
                "then get the whole sequence; CP may not be exact"
            )
    return _unmerged(outputs, came_from, mapper), nodes


def _unmerged(
    outputs: dict[str, int], came_from: dict[str, tuple[str, int]], mapper: AxisMapper
) -> dict[str, int]:
    """``outputs`` with each gather along a merged axis whose outer factor is not the
    sequence (``batch*sequence``: the dynamo exporter's GPT-2 flattens its tokens for each
    projection) moved up to the tensor it was walked from before the merge. The ranks' parts of
    such an axis, joined, interleave the batch's rows: exact at batch 1 only."""
    moved: dict[str, int] = {}
    for tensor, axis in outputs.items():
        while _batch_outside(mapper, tensor, axis) and tensor in came_from:
            tensor, axis = came_from[tensor]
        moved.setdefault(tensor, axis)
    return moved


def _batch_outside(mapper: AxisMapper, tensor: str, axis: int) -> bool:
    """Whether ``tensor``'s ``axis`` merges the sequence under another dim (batch*sequence)."""
    shape = mapper.shapes.shape(tensor)
    dim = shape[axis] if shape is not None and axis < len(shape) else None
    seq = mapper.seq
    if not isinstance(dim, str) or not isinstance(seq, str) or "*" not in dim:
        return False
    factors = dim.split("*")
    return seq in factors and factors[0] != seq


class _WholeReads:
    """Whether a node reached by the walk forward from ``tensor`` reads along ``out_axis``
    another tensor that every rank holds whole: one of ``forced``. Meanwhile the other data
    inputs it reads along the axis that the walks have not found to be slices are kept
    (``pending``, with the node), for _gathered to settle once the walk has ended."""

    def __init__(self, derived: set[str], forced: set[int], inside_layers: set[int]) -> None:
        self.derived = derived
        self.forced = forced
        # A layer's inside reads its masks whole along the keys: the walk back placed its cuts.
        self.inside_layers = inside_layers
        self.pending: list[tuple[int, str]] = []
        # What the walk forward reached: it fills this set as it goes.
        self.reached: set[str] = set()

    def __call__(
        self, node: Node, tensor: str, out_axis: int, mapper: AxisMapper, region: set[str]
    ) -> bool:
        if node.index in self.forced:
            return True
        inputs = node.inputs
        if len(inputs) < 2 or node.index in self.inside_layers:
            return False
        # The region's tensors and what the walk reached are slices: most nodes read no
        # other data, and the mapper is not asked.
        derived, reached = self.derived, self.reached
        others = [
            name
            for name in inputs
            if name in derived and name != tensor and name not in region and name not in reached
        ]
        if others:
            along = {name for name, _ in mapper.input_axes(node, out_axis) or ()}
            self.pending.extend((node.index, name) for name in others if name in along)
        return False


class _GraphOrder:
    """A tensor's position in the graph: graph inputs, then initializers, then node outputs
    (by their node). Asked of the few tensors to scatter and gather only."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self.inputs = {name: i for i, name in enumerate(index.graph_inputs)}
        self._initializers: dict[str, int] | None = None

    def __call__(self, tensor: str) -> int:
        index = self.index
        position = self.inputs.get(tensor)
        if position is not None:
            return position
        if tensor in index.initializers:
            if self._initializers is None:
                self._initializers = {name: i for i, name in enumerate(index.initializers)}
            return len(self.inputs) + self._initializers[tensor]
        producer = index.producer.get(tensor)
        if producer is None:
            return 0
        return len(self.inputs) + len(index.initializers) + producer


def _ordered(
    order: _GraphOrder, shapes: ShapeInference, tensors: dict[str, int]
) -> list[CutTensor]:
    return [
        CutTensor(name, axis, shapes.rank(name))
        for name, axis in sorted(tensors.items(), key=lambda item: (order(item[0]), item[0]))
    ]
