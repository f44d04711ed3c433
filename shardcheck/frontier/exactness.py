"""The "no exact cut" warnings: places where, once the frontier is found, no cut makes CP
exact (a scattered tensor computed from a slice, a layer's inside sized by the wrong length,
a cut given the length of a slice).
"""

from __future__ import annotations

from collections import deque

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.layer_insides import key_slices
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import mentions
from shardcheck.frontier.gathers import gathered_kv
from shardcheck.frontier.kv_readers import layout_chain
from shardcheck.frontier.region import Region
from shardcheck.frontier.sliced import SlicedTest
from shardcheck.frontier.sources import (
    ShapeSources,
    shape_like_ancestors,
    size_source_off_region,
)
from shardcheck.frontier.tensor_ids import TensorIds
from shardcheck.graph.index import Dim, GraphIndex, Node
from shardcheck.graph.ops import RESIZING_OPS, SHAPE_OPS


def warn_no_exact_cut(
    index: GraphIndex,
    shapes: ShapeInference,
    mapper: AxisMapper,
    layers: list[AttentionLayer],
    sources: ShapeSources,
    region: Region,
    gathered: dict[str, int],
    cut_lengths: list[tuple[int, int]],
    sequences: tuple[Dim, ...],
    warnings: list[str],
    *,
    lengths_given: bool = False,
) -> None:
    """Appends to ``warnings`` each place the final ``region`` and ``gathered`` leave without an
    exact cut. ``cut_lengths``: the cuts whose length a cut is computed from, with the Shape's
    output (ids), as the last round's must_be_whole found them. ``lengths_given``: the
    extension's frontier, whose shard computes what it scatters with the whole length
    (sharding/lengths.py): no cut reads a slice's length. ``sequences``: the sequence dims
    (the mapper's), the model's first."""
    tensors = set(region.tensors)
    _warn_cuts_from_slices(index, layers, region.cut, gathered, warnings)
    _warn_layer_insides(
        index,
        shapes,
        layers,
        sources,
        (tensors, region.cut),
        sequences,
        warnings,
        lengths_given=lengths_given,
    )
    if lengths_given:
        # The shard gives a Reshape of the scores the keys' whole length (sharding/lengths.py).
        return
    _warn_key_lengths(index, shapes, mapper, layers, sources, tensors, warnings)
    lengths = [*cut_lengths, *_lengths_of_slices(index, layers, sources, region, gathered)]
    _warn_cut_lengths(index, shapes, layers, sources.ids, region, lengths, sequences, warnings)


def _warn_cuts_from_slices(
    index: GraphIndex,
    layers: list[AttentionLayer],
    cut: dict[str, int],
    gathered: dict[str, int],
    warnings: list[str],
) -> None:
    """Follow what each rank holds in slices, from the scattered tensors to the gathered ones;
    a scattered tensor computed from a slice means no cut makes CP exact there."""
    whole_when_read = set(gathered) | gathered_kv(layers)
    sliced = set(cut)
    for node in index.nodes:
        if node.op_type in SHAPE_OPS or sliced.isdisjoint(node.inputs):
            continue
        reads = [name for name in node.inputs if name in sliced and name not in whole_when_read]
        if not reads:
            continue
        for output in node.outputs:
            if output in cut:
                warnings.append(
                    f"no exact cut at {output}: it is scattered, but {node.label} computes it "
                    f"from {reads[0]}, which each rank holds a slice of; CP may not be exact"
                )
            elif output:
                sliced.add(output)


def _warn_layer_insides(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    sources: ShapeSources,
    walked: tuple[set[str], dict[str, int]],
    sequences: tuple[Dim, ...],
    warnings: list[str],
    *,
    lengths_given: bool = False,
) -> None:
    """Inside a layer (between its score and context MatMuls) nothing can be cut: a node there
    sized by the Shape of a tensor off the region (``walked``: the region and its cuts) gets
    the wrong length next to the scores: the whole one for a tensor the cuts leave whole
    (Bloom's dynamo export reshapes its scores with attention_mask's length), a slice's for
    one computed from a slice off the walk (MPT slices its ALiBi bias to the length of a
    transposed copy of K, before K is gathered). With ``lengths_given`` (the extension), the
    shard gives a Reshape or Expand of the scores a rank's length along the queries in place
    of the whole one, and a Slice of a table along the keys the whole length in place of a
    rank's (sharding/lengths.py)."""
    region, cut = walked
    sliced = SlicedTest(sources.ids, [sources.ids.id[name] for name in cut])
    along_keys = key_slices(index, shapes, layers) if lengths_given else frozenset()
    for layer in layers:
        # The layer's own tensors (its scores) hold a rank's queries and every key, as the
        # nodes between them need: DeBERTa views its scores with their own shape.
        own = {output for at in layer.internal for output in index.nodes[at].outputs}
        for node_index in layer.internal:
            node = index.nodes[node_index]
            source = (
                None if node.op_type in SHAPE_OPS else size_source_off_region(node, sources, region)
            )
            if source is None or source in own:
                continue
            if not _may_carry_length(index, shapes, sources, node, sequences):
                continue
            whole = not sliced(sources.ids.id[source])
            if whole and lengths_given and node.op_type in RESIZING_OPS:
                continue
            if any(_produced_by(index, name, along_keys) for name in node.inputs):
                continue  # the shard gives that Slice the keys' whole length
            held = "every rank holds whole" if whole else "each rank holds a slice of"
            warnings.append(
                f"no exact cut inside layer {layer.name}: {node.label} is sized by the length "
                f"of {source}, which {held}; CP may not be exact"
            )
            break


def _produced_by(index: GraphIndex, tensor: str, nodes: frozenset[str]) -> bool:
    producer = index.producer_of(tensor) if tensor else None
    return producer is not None and producer.name in nodes


def _may_carry_length(
    index: GraphIndex,
    shapes: ShapeInference,
    sources: ShapeSources,
    node: Node,
    sequences: tuple[Dim, ...],
) -> bool:
    """Whether a shape-like input of ``node`` may hold the sequence length: not when every
    value it is computed from is known and free of it (a scale of ``hidden // heads ** -0.5``
    read from the hidden size of ``x``'s Shape, as TorchScript traces it)."""

    def free_of_it(tensor: str) -> bool:
        value = shapes.value(tensor)
        return _without_sequences(value, sequences) or _without_fixed_length(value, sequences[0])

    for tensor, producer in shape_like_ancestors(
        index, sources.derived, list(node.inputs), free_of_it
    ):
        if producer is None and tensor not in index.initializers:
            return True
        if producer is not None and producer.op_type in SHAPE_OPS:
            return True
    return False


def _warn_key_lengths(
    index: GraphIndex,
    shapes: ShapeInference,
    mapper: AxisMapper,
    layers: list[AttentionLayer],
    sources: ShapeSources,
    region: set[str],
    warnings: list[str],
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
            for name in layout_chain(index, sources.derived, k_or_v, gathered)
            if name in region
        }
        for node_index in layer.internal:
            node = index.nodes[node_index]
            rank = shapes.rank(node.outputs[0]) if node.outputs else None
            if node_index not in sources.sizable or not rank:
                continue
            sized_by = sources.sizing(node_index, rank - 1, mapper) & before_gather
            if sized_by:
                warnings.append(
                    f"no exact cut inside layer {layer.name}: {node.label} is sized along the "
                    f"keys by the length of {names[min(sized_by)]}, which each rank holds a "
                    "slice of before K and V are gathered; CP may not be exact"
                )
                break


def _lengths_of_slices(
    index: GraphIndex,
    layers: list[AttentionLayer],
    sources: ShapeSources,
    region: Region,
    gathered: dict[str, int],
) -> list[tuple[int, int]]:
    """The Shape reads (read tensor, Shape's output, as ids) of tensors that ranks hold
    slices of, off the region, that size a cut through shape-like values: the cut gets a
    slice's length (the einsum export's causal mask, ``triu(j - i + 1)`` of the scores' own
    shape, made from each rank's rows). The region's own Shape reads push the cut forward
    (whole.py); these cannot."""
    ids = sources.ids
    whole = [ids.id[name] for name in (*gathered, *gathered_kv(layers)) if name in ids.id]
    sliced = SlicedTest(ids, region.cut_ids, whole=whole)
    found: list[tuple[int, int]] = []
    for node in index.nodes:
        if node.op_type not in SHAPE_OPS or not node.inputs or not node.outputs[0]:
            continue
        read = ids.id.get(node.inputs[0])
        if read is None or region.in_region[read] or not sliced(read):
            continue
        if _sizes_a_cut(index, sources.derived, region.cut, node.outputs[0]):
            found.append((read, ids.id[node.outputs[0]]))
    return found


def _sizes_a_cut(index: GraphIndex, derived: set[str], cut: dict[str, int], length: str) -> bool:
    """Whether ``length`` (a Shape's output) reaches a cut through shape-like values alone."""
    pending, seen = [length], {length}
    while pending:
        for consumer in index.consumers_of(pending.pop()):
            for output in consumer.outputs:
                if output in cut:
                    return True
                if output and output not in seen and output not in derived:
                    seen.add(output)
                    pending.append(output)
    return False


def _warn_cut_lengths(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    ids: TensorIds,
    region: Region,
    cut_lengths: list[tuple[int, int]],
    sequences: tuple[Dim, ...],
    warnings: list[str],
) -> None:
    """A cut is computed whole on every rank, then scattered; one computed from the length of
    another cut reads it after the scatter: a slice's length, where it needs the whole one.
    That cut cannot move forward when it is the query side of a layer (TorchScript's GPT-Neo
    slices its causal mask from row ``len(K) - len(Q)``), so no exact cut is left. The gathered
    K and V are whole when read, and a length that the sequence does not reach (a batch or a
    head size) is harmless."""
    gathered = gathered_kv(layers)
    warned: set[int] = set()
    for read, shape_output in sorted(set(cut_lengths)):
        if read in warned or ids.names[read] in gathered:
            continue
        sized = _cut_sized_by(index, shapes, region, ids.names[shape_output], sequences)
        if sized is None:
            continue
        warned.add(read)
        shape_node = index.nodes[ids.producer[shape_output]]
        warnings.append(
            f"no exact cut at {sized}: it is computed whole and scattered, but "
            f"{shape_node.label} gives it the length of {ids.names[read]}, which each rank "
            "holds a slice of; CP may not be exact"
        )


def _cut_sized_by(
    index: GraphIndex,
    shapes: ShapeInference,
    region: Region,
    length: str,
    sequences: tuple[Dim, ...],
) -> str | None:
    """The first cut that ``length`` (a Shape's output) sizes along a path a sequence length
    may take: forward through tensors off the region, leaving those whose value is known and
    holds none of ``sequences``."""
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
                if output in tensors or _without_sequences(shapes.value(output), sequences):
                    continue
                queue.append(output)
    return None


def _without_fixed_length(value: tuple[Dim, ...] | None, seq: Dim | None) -> bool:
    """Whether a shape-like value is known and holds no dim of a fixed sequence length ``seq``
    (an int: a fixed-length export's; DETR's object queries are Expand-ed by the batch)."""
    if value is None or not isinstance(seq, int):
        return False
    return all(dim is not None and dim != seq for dim in value)


def _without_sequences(value: tuple[Dim, ...] | None, sequences: tuple[Dim, ...]) -> bool:
    """Whether a shape-like value is known and holds none of the sequence dims ``sequences``
    (an encoder-decoder's decoder length is one too)."""
    return all(_without_sequence(value, seq) for seq in sequences)


def _without_sequence(value: tuple[Dim, ...] | None, seq: Dim | None) -> bool:
    """Whether a shape-like value is known and none of its dims is, or is computed from, the
    sequence length ``seq``."""
    if value is None or not isinstance(seq, str):
        return False
    return all(dim is not None and not mentions(dim, seq) for dim in value)
