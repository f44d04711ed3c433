"""Which tensors to scatter and gather (the CP frontier), found in rounds of walks.

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

from collections.abc import Set as AbstractSet

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer, sequence_dims
from shardcheck.analysis.selections import selection_counts
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.frontier.exactness import warn_no_exact_cut
from shardcheck.frontier.exposed import (
    ExposedLayers,
    exposed_in_region,
    exposed_layers,
    gathered_for_output,
    passed_through,
)
from shardcheck.frontier.gathers import WholeReads, gathered_kv, walk_forward
from shardcheck.frontier.kv_readers import KvGathers, kv_chains
from shardcheck.frontier.masks import layer_seeds, whole_sized_masks
from shardcheck.frontier.region import BackWalk
from shardcheck.frontier.result import Frontier, GraphOrder, in_graph_order
from shardcheck.frontier.sliced import SlicedTest
from shardcheck.frontier.sources import ShapeSources
from shardcheck.frontier.tensor_ids import TensorIds
from shardcheck.frontier.whole import (
    must_be_whole,
    read_by_mixing,
    sized_by_slices,
    sized_whole,
    sliced_beside,
)
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.ops import SHAPE_OPS
from shardcheck.hints.model import ReaderGather

# A cap on the rounds of find_frontier (cuts moving forward) and of _gathered (nodes forced to
# take a gathered tensor), so that no graph loops them.
MAX_ROUNDS = 12


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


def find_frontier(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    *,
    lengths_by_reader: bool = False,
) -> Frontier:
    """The tensors to scatter and to gather for the attention ``layers``, and the warnings of
    the places where no cut makes CP exact.

    ``lengths_by_reader``: the frontier of the extension (hints/extension.py), where
    ``shardcheck shard`` gives every node that reads a length the one it needs (the whole
    length off the region, a rank's inside it: sharding/lengths.py), so that no length read
    moves a cut. Without it, the frontier of the Polygraphy format, where a Shape reads what
    its tensor's other consumers read."""
    result = Frontier()
    if not layers:
        return result
    seq, *others = sequence_dims(shapes, layers)
    mapper = AxisMapper(index, shapes, seq, others)
    derived = data_derived(index)
    seeds = list(layer_seeds(index, shapes, mapper, layers))
    # The extension walks back from the graph outputs that copy a tensor too (exposed.py).
    copies = passed_through(index, shapes, seq) if lengths_by_reader else []
    seeds.extend(copies)

    # Tensors that must be computed whole on every rank. A cut next to one of them moves to
    # its consumers; rounds repeat until nothing new must be whole (each round moves forward).
    # A layer computing Q, K and V from one input (a packed com.microsoft Attention) gets that
    # input gathered as its K and V, and so its Q: its output is whole on every rank.
    # So is the output of a layer whose Q or inside is a graph output, gathered there; but in
    # the extension, which gathers what is given out for the graph output alone.
    exposed = exposed_layers(index, shapes, layers, first_only=not lengths_by_reader)
    given_out, exposed = (exposed, ExposedLayers()) if lengths_by_reader else (None, exposed)
    whole: set[str] = {layer.output for layer in layers if layer.packed} | exposed.outputs
    layer_outputs = {layer.output: layer for layer in layers if layer.output not in whole}
    # This first walk only gives the nodes after the layers; the last one, once the region is
    # known, gives the tensors to gather and the warnings.
    # What the experts' counts of their tokens are computed for (selections.py).
    counts = selection_counts(shapes)
    _, forward_nodes = walk_forward(
        index, mapper, layers, [], whole_outputs=frozenset(exposed.outputs), counts=counts
    )
    ids = TensorIds(index)
    layer_output_flags = ids.flags(layer_outputs)
    inside_layers = {node for layer in layers for node in layer.internal}
    # What the layers compute inside (their scores): sliced along the queries.
    layers_own = {output for at in inside_layers for output in index.nodes[at].outputs}
    sources = ShapeSources(index, ids, derived, shapes)
    # The walk ends at a layer's output, and at what it computes inside: DiffLlama weighs a
    # second half of V by a layer's probabilities, beside it, and what that product reads
    # beside the walk is the layer's own business (kv_readers.py), not a cut's.
    ends = {
        output: layer
        for layer in layer_outputs.values()
        for at in layer.internal
        for output in index.nodes[at].outputs
        if output
    }
    back = BackWalk(
        index,
        mapper,
        ids,
        sources.derived_flags,
        {**ends, **layer_outputs},
        through_broadcasts=lengths_by_reader,
    )
    # The extension gathers K and V for the nodes that read them beside their layer.
    chains = kv_chains(index, derived, layers) if lengths_by_reader else set()
    kv_gathers: KvGathers = {}
    mixing_gathers: KvGathers = {}
    # The rounds find the cuts; the gathers follow from them. A length read after the gathers
    # from a tensor ranks hold slices of makes that tensor whole, and the rounds run again; in
    # the extension too, whose shard gives the whole length only to the Gathers indexing
    # whole data (sharding/lengths.py).
    for _ in range(MAX_ROUNDS):
        for _ in range(MAX_ROUNDS):
            mixing_gathers = {}
            walked = back.walk(seeds, whole)
            region, cut = walked.tensors, walked.cut
            cut_lengths: list[tuple[int, int]] = []
            needed = must_be_whole(
                index,
                ids,
                walked,
                forward_nodes,
                layer_output_flags,
                cut_lengths,
                lengths_by_reader=lengths_by_reader,
            )
            if not lengths_by_reader:
                needed |= sized_whole(index, mapper, sources, walked)
            beside, kv_gathers = sliced_beside(
                index,
                ids,
                walked,
                chains,
                (mapper, layers_own) if lengths_by_reader else None,
                counts,
            )
            needed |= beside
            if given_out is None:
                needed |= exposed_in_region(index, walked, {tensor for tensor, _ in seeds})
            needed |= exposed.read_beside(index, layers, walked)
            needed -= whole
            masks = whole_sized_masks(
                index, shapes, mapper, sources, layers, (region, layers_own), seeds
            )
            if not needed and not masks:
                # Checked last, once the rest holds (it reads every node): a region tensor read
                # by an op that mixes positions along its axis, beside the walk.
                needed, mixing_gathers = read_by_mixing(
                    index,
                    mapper,
                    walked,
                    inside_layers,
                    layers_own if lengths_by_reader else None,
                    counts,
                )
                needed -= whole
                if not needed:
                    break
            whole |= needed
            seeds.extend(masks)
        gather_warnings: list[str] = []
        given_forward: dict[str, int] | None = None if given_out is None else {}
        # Again, now that the region is known: a position-wise op sized by a whole tensor's Shape
        # (a Reshape back to [batch, sequence, hidden] with the length of an unsliced input) gets
        # the gathered tensor.
        gathered = _gathered(
            index,
            mapper,
            layers,
            gather_warnings,
            sources,
            set(region),
            walked.cut_ids,
            inside_layers,
            sized=not lengths_by_reader,
            whole_outputs=frozenset(exposed.outputs),
            given_out=given_forward,
            counts=counts,
        )
        whole_when_read = [ids.id[name] for name in (*gathered, *gathered_kv(layers))]
        late = sized_by_slices(index, shapes, sources, walked, gathered, whole_when_read) - whole
        if not late:
            break
        whole |= late
    result.warnings.extend(gather_warnings)
    order = GraphOrder(index)
    result.inputs = in_graph_order(
        order, shapes, {name: axis for name, axis in cut.items() if name not in exposed.queries}
    )
    result.region_nodes = frozenset(walked.nodes)
    for name, (axis, readers) in mixing_gathers.items():
        earlier = kv_gathers.get(name, (axis, ()))[1]
        kv_gathers[name] = (axis, tuple(sorted({*earlier, *readers})))
    result.kv_for_readers = tuple(
        ReaderGather(name, axis, readers) for name, (axis, readers) in sorted(kv_gathers.items())
    )
    gathered.update((name, axis) for name, axis in exposed.points.items() if name not in cut)
    for_output: set[str] = set()
    if given_out is not None:
        seen = {tensor for tensor, _ in seeds} - {name for name, _ in copies}
        found = {**(given_forward or {}), **gathered_for_output(index, walked, seen, given_out)}
        # One that only the graph output reads (a Shape aside) is gathered as in the hints.
        for_output = {
            name
            for name in set(found) - set(gathered)
            if any(node.op_type not in SHAPE_OPS for node in index.consumers_of(name))
        }
        gathered.update((name, found[name]) for name in set(found) - set(gathered))
    result.outputs = in_graph_order(order, shapes, gathered)
    result.for_output = tuple(tensor.name for tensor in result.outputs if tensor.name in for_output)
    warn_no_exact_cut(
        index,
        shapes,
        mapper,
        layers,
        sources,
        walked,
        gathered,
        cut_lengths,
        mapper.sequences,
        result.warnings,
        lengths_given=lengths_by_reader,
    )
    return result


def _gathered(
    index: GraphIndex,
    mapper: AxisMapper,
    layers: list[AttentionLayer],
    warnings: list[str],
    sources: ShapeSources,
    region: set[str],
    cut: list[int],
    inside_layers: set[int],
    *,
    sized: bool = True,
    whole_outputs: frozenset[str] = frozenset(),
    given_out: dict[str, int] | None = None,
    counts: AbstractSet[str] = frozenset(),
) -> dict[str, int]:
    """The tensors to gather (with their axes); the warnings of the walk forward go to
    ``warnings``; ``given_out``, where given, the graph outputs gathered for themselves alone
    (the extension's: see walk_forward).

    A node that also reads a tensor every rank holds whole gets the gathered tensor. Which
    tensors those are depends on the gathers (what follows one is whole), so the walk takes
    every other input it reads for a slice; an input it did not reach that is computed from
    no slice once its gathers are known (and those of the layers' K and V) forces the node to
    take the gathered tensor, and the walk repeats until no more nodes are forced. Unless
    ``sized`` is False, a node sized by a whole tensor's Shape takes the gathered tensor."""
    ids = sources.ids
    kv = [ids.id[name] for name in gathered_kv(layers)]
    forced: set[int] = set()
    for _ in range(MAX_ROUNDS):
        reads_whole = WholeReads(sources.derived, forced, inside_layers)
        walk_warnings: list[str] = []
        if given_out is not None:
            given_out.clear()
        gathered, _ = walk_forward(
            index,
            mapper,
            layers,
            walk_warnings,
            sources,
            region,
            reads_whole,
            sized=sized,
            whole_outputs=whole_outputs,
            given_out=given_out,
            counts=counts,
        )
        reached = reads_whole.reached
        unsettled = [(node, name) for node, name in reads_whole.pending if name not in reached]
        if not unsettled:
            break
        sliced = SlicedTest(ids, cut, whole=[*kv, *(ids.id[name] for name in gathered)])
        more = {node for node, name in unsettled if not sliced(ids.id[name])}
        if more <= forced:
            break
        forced |= more
    warnings.extend(walk_warnings)
    return gathered
