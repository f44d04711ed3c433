"""K and V read beside their layer before the gather: gathered for those readers too.

DeBERTa's disentangled attention multiplies each layer's K by the relative position table
(position-to-content scores, ``K @ pos_q^T``) before the layer gathers K at its score MatMul.
Those scores are indexed along the queries, so every rank needs them over every key: computed
from its slice of K, they would cover its own keys only. Making K whole there would move the cut
before the projections; the extension gathers K for those readers instead, as the layer itself
does, and the projections keep running on slices.

DiffLlama splits V in two halves: the layer weighs one by its probabilities, a second product
beside it the other. That half is gathered for its product (values_for_products), as the layer
gathers its own V, and V's projection keeps running on slices too.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer
from shardcheck.frontier.region import Region
from shardcheck.frontier.sliced import SlicedTest
from shardcheck.frontier.tensor_ids import TensorIds
from shardcheck.graph.index import GraphIndex, Node

# A tensor of a layer's K or V chain to gather, its axis, and the nodes that read it whole.
KvGathers = dict[str, tuple[int, tuple[str, ...]]]


def kv_chains(index: GraphIndex, derived: set[str], layers: Iterable[AttentionLayer]) -> set[str]:
    """The tensors from each layer's K and V up to what the layer gathers, without it."""
    chains: set[str] = set()
    for layer in layers:
        for start, end in ((layer.k, layer.gathered_k), (layer.v, layer.gathered_v)):
            chains.update(layout_chain(index, derived, start, end))
    return chains


def layout_chain(index: GraphIndex, derived: set[str], start: str, end: str) -> list[str]:
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


def gathered_for_readers(
    index: GraphIndex,
    ids: TensorIds,
    region: Region,
    chains: AbstractSet[str],
    sliced: SlicedTest,
    read: list[int],
) -> tuple[list[int], KvGathers]:
    """Of the sliced tensors ``read`` beside the walk, those computed from the region through
    K or V chains alone (``chains``), with the chain tensors gathered for the nodes off the
    region that read them; and the rest, which must be whole as before."""
    names, parents, producers = ids.names, ids.parents, ids.producer
    in_region = region.in_region
    gathers: dict[str, set[str]] = {}
    rest: list[int] = []
    for tensor in read:
        found: dict[str, set[str]] = {}
        queue, seen, ok = [tensor], {tensor}, True
        while queue and ok:
            current = queue.pop()
            reader = index.nodes[producers[current]].name if producers[current] >= 0 else ""
            for parent in parents[current] or ():
                if in_region[parent]:
                    name = names[parent]
                    if name not in chains or not reader:
                        ok = False
                        break
                    found.setdefault(name, set()).add(reader)
                elif parent not in seen and sliced(parent):
                    seen.add(parent)
                    queue.append(parent)
        if ok and found:
            for name, readers in found.items():
                gathers.setdefault(name, set()).update(readers)
        else:
            rest.append(tensor)
    axes = region.tensors
    return rest, {name: (axes[name], tuple(sorted(readers))) for name, readers in gathers.items()}


def weighs_by_probabilities(
    mapper: AxisMapper, node: Node, tensor: str, axis: int, probabilities: AbstractSet[str]
) -> bool:
    """Whether ``node`` is a MatMul of a layer's probabilities (computed inside it: a rank's
    queries over every key) by ``tensor``, contracting ``tensor``'s ``axis``, its keys."""
    if node.op_type != "MatMul" or len(node.inputs) != 2:
        return False
    weights, values = node.inputs
    rank = mapper.shapes.rank(values)
    return values == tensor and weights in probabilities and rank is not None and axis == rank - 2


def values_for_products(
    index: GraphIndex,
    ids: TensorIds,
    mapper: AxisMapper,
    region: Region,
    sliced: SlicedTest,
    probabilities: AbstractSet[str],
    read: list[int],
) -> tuple[list[int], KvGathers]:
    """Of the sliced tensors ``read`` beside the walk, those that only MatMuls of a layer's
    probabilities read in the region, along their keys: gathered for those products. And the
    rest, as before."""
    gathers: KvGathers = {}
    rest: list[int] = []
    for tensor in read:
        name = ids.names[tensor]
        readers = [node for node in index.consumers_of(name) if node.index in region.nodes]
        axis = _carried_axis(index, ids, mapper, region, sliced, tensor) if readers else None
        if axis is not None and all(
            weighs_by_probabilities(mapper, node, name, axis, probabilities) for node in readers
        ):
            gathers[name] = (axis, tuple(sorted({node.name for node in readers})))
        else:
            rest.append(tensor)
    return rest, gathers


def _carried_axis(
    index: GraphIndex,
    ids: TensorIds,
    mapper: AxisMapper,
    region: Region,
    sliced: SlicedTest,
    tensor: int,
) -> int | None:
    """The axis a rank's slice of ``tensor`` is along: forward from its region tensor, where
    each node on the way computes from one sliced input, through ops that map the axis; None
    where there is no such chain."""
    path: list[tuple[int, str]] = []
    current = tensor
    for _ in range(64):
        if region.in_region[current]:
            break
        producer = ids.producer[current]
        data = [parent for parent in ids.parents[current] or () if sliced(parent)]
        if producer < 0 or len(data) != 1:
            return None
        current = data[0]
        path.append((producer, ids.names[current]))
    else:
        return None
    axis: int | None = region.tensors[ids.names[current]]
    for producer, name in reversed(path):
        axis = mapper.output_axis(index.nodes[producer], name, axis)
        if axis is None:
            return None
    return axis
