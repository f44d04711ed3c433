"""Where the walk back starts: the layers' Q, K and V, and the masks each rank needs its own
rows of (a causal mask, one whose query axis comes from a graph input, and, found between
rounds, one sized by a whole tensor's Shape or made from relative positions)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.causal import reaches_range
from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import always_one
from shardcheck.frontier.gathers import gathered_kv
from shardcheck.frontier.sources import ShapeSources
from shardcheck.graph.index import GraphIndex, Node


def layer_seeds(
    index: GraphIndex, shapes: ShapeInference, mapper: AxisMapper, layers: list[AttentionLayer]
) -> Iterable[tuple[str, int]]:
    """The tensors the walk back starts from, with their sequence axes: each layer's Q, K and
    V, and those of its masks whose rows each rank needs."""
    for layer in layers:
        # K and V of a context (cross-attention to another length) stay whole on every rank,
        # as do latents: their queries, and the rows of their masks.
        kv_axes = (None, None) if layer.kv_context is not None else (layer.k_axis, layer.v_axis)
        q_axis = None if layer.latents is not None else layer.q_axis
        for tensor, axis in (
            (layer.q, q_axis),
            (layer.gathered_k, kv_axes[0]),
            (layer.gathered_v, kv_axes[1]),
        ):
            if axis is not None:
                yield tensor, axis
        if layer.latents is not None:
            continue
        for mask in layer.masks:
            mask_shape = shapes.shape(mask)
            if mask_shape is None or len(mask_shape) < 2 or always_one(mask_shape[-2]):
                continue
            # The mask broadcasts against the scores [..., query, key]. A causal mask differs
            # from row to row: each rank needs its rows. A padding mask only broadcast along
            # the query axis is computed locally as it stands, as is a sink column: the same
            # on every row.
            axis = len(mask_shape) - 2
            row_wise = layer.causal is not None and mask not in layer.sinks
            if row_wise or _axis_ends(index, mapper, mask, axis)[1]:
                yield mask, axis


def whole_sized_masks(
    index: GraphIndex,
    shapes: ShapeInference,
    mapper: AxisMapper,
    sources: ShapeSources,
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
    gathered = gathered_kv(layers)
    found: list[tuple[str, int]] = []
    for layer in layers:
        for mask in layer.masks:
            shape = shapes.shape(mask)
            if mask in seeded or shape is None or len(shape) < 2 or always_one(shape[-2]):
                continue
            axis = len(shape) - 2
            # One key column (a sink) is no key length a rank could build short.
            if not always_one(shape[-1]) and _keys_sized_by_a_slice(
                index, mapper, sources, mask, len(shape) - 1, region, gathered
            ):
                found.append((mask, axis))
                seeded.add(mask)
                continue
            mixing: set[str] = set()
            for origin in _axis_ends(index, mapper, mask, axis, mixing)[0]:
                producer = index.producer_of(origin)
                inputs = [origin] if producer is None else [n for n in producer.inputs if n]
                sized_by = {
                    s for name in inputs if name not in sources.derived for s in sources.of(name)
                }
                positional = producer is not None and _relative_position(index, producer)
                # A constant holding the query rows (a fixed-length export's mask, Expand-ed
                # by the batch only: the dynamo DeiT's) keeps them whole on every rank.
                rows = (producer is None or producer.op_type == "Constant") and shape[-2] in (
                    shapes.shape(origin) or ()
                )
                # Data whose query axis an op mixes (Funnel's relative shift, a Reshape of the
                # positional scores [.., queries, keys] to [.., keys, queries]): a rank's rows of
                # it are no rows of the whole.
                mixed = origin in mixing and origin in sources.derived
                if (
                    rows
                    or positional
                    or mixed
                    or any(source not in region and source not in layers_own for source in sized_by)
                ):
                    found.append((mask, axis))
                    seeded.add(mask)
                    break
    return found


def _keys_sized_by_a_slice(
    index: GraphIndex,
    mapper: AxisMapper,
    sources: ShapeSources,
    mask: str,
    key_axis: int,
    region: dict[str, int],
    gathered: set[str],
) -> bool:
    """Whether the key axis of ``mask`` is created from the Shape of a tensor ranks hold a
    slice of (a region tensor other than the gathered K and V): ALiBi or a window built from
    ``Range(Shape(x)[1])`` inside the model. Each rank would build it over its own local
    length, where the keys are whole; computed whole and scattered along its query axis, it
    is exact (the Shape's tensor must then be whole: the cut moves past it)."""
    for origin in _axis_ends(index, mapper, mask, key_axis)[0]:
        producer = index.producer_of(origin)
        inputs = [origin] if producer is None else [n for n in producer.inputs if n]
        for name in inputs:
            if name in sources.derived:
                continue
            if any(s in region and s not in gathered for s in sources.of(name)):
                return True
    return False


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
    index: GraphIndex,
    mapper: AxisMapper,
    tensor: str,
    axis: int,
    mixed: set[str] | None = None,
) -> tuple[list[str], bool]:
    """Where an axis begins, followed back through position-wise ops on every path: the
    tensors that create it, and whether some path reaches a graph input's own axis.
    ``mixed`` gets those of the tensors that an op mixing positions makes (not a broadcast)."""
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
            if mapped is None and mixed is not None:
                mixed.add(current[0])
    return origins, from_input
