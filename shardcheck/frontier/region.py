"""The backward walk of a round: the region CP shards, walked back from the seeds.

From Q, K, V and the query side of the masks, back through position-wise ops, to where the
walk stops: a graph input, a tensor computed from shapes and constants alone (in the
extension's walk, past an Expand that broadcasts such a table), a tensor that must be whole, or
an op that mixes positions. Those stops are the cuts (the tensors to scatter).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardcheck.analysis.axes import AxisMapper, carries_any
from shardcheck.analysis.detect import AttentionLayer
from shardcheck.frontier.tensor_ids import TensorIds
from shardcheck.graph.index import GraphIndex

# The mapper's answer not asked yet (None is an answer: the op mixes positions).
_NOT_ASKED: list[tuple[int, int]] = []


class BackWalk:
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
        *,
        through_broadcasts: bool = False,
    ) -> None:
        self.index = index
        self.mapper = mapper
        self.ids = ids
        self.derived = derived  # flags by tensor id
        self.through_broadcasts = through_broadcasts
        self.layer_outputs = {ids.id[name]: layer for name, layer in layer_outputs.items()}
        self.mapped: dict[tuple[int, int], list[tuple[int, int]] | None] = {}
        # What the node reads beside the mapped inputs (broadcast along the axis walked),
        # computed from data: each rank reads it as it holds it.
        self.beside: dict[tuple[int, int], tuple[int, ...]] = {}

    def walk(self, seeds: list[tuple[str, int]], whole: set[str]) -> Region:
        """The region walked back from ``seeds``, stopping at the tensors of ``whole`` (to be
        computed whole on every rank) and at those a node computes from one of them."""
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
            if (
                producer_index < 0
                or whole_flags[tensor]
                or (
                    not derived[tensor]
                    and not self._broadcasts_a_table(producer_index, axis)
                    and not self._filled_like(producer_index)
                    and not self._fill_for_rank(producer_index, axis)
                )
            ):
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
        return Region(
            {names[tensor]: axis for tensor, axis in region.items()},
            region_nodes,
            {names[tensor]: axis for tensor, axis in cut.items()},
            in_region,
            list(cut),
            read_beside,
        )

    def _filled_like(self, producer: int) -> bool:
        """Whether ``producer`` is a ConstantOfShape of a tensor's whole Shape (the zeros
        TorchScript's experts add their outputs into, the size of the zeros before): on a
        rank it is the size of what the rank holds of that tensor, which the walk reaches
        through it (axes.py), instead of a cut computed whole and scattered."""
        node = self.index.nodes[producer]
        if node.op_type != "ConstantOfShape":
            return False
        shape = self.index.producer_of(node.inputs[0])
        return (
            shape is not None
            and shape.op_type == "Shape"
            and shape.attr("start", 0) == 0
            and shape.attr("end") is None
        )

    def _fill_for_rank(self, producer: int, axis: int) -> bool:
        """Whether ``producer`` fills a buffer with a constant (an Expand of one element: the
        zeros a sorting dispatch of experts writes each expert's rows back into), whose one
        axis of a sequence's length is ``axis``: where asked (the extension's walk), the rank
        builds it at its own length (sharding/lengths.py), rather than every rank building
        it whole and receiving its slice."""
        if not self.through_broadcasts:
            return False
        node = self.index.nodes[producer]
        if node.op_type != "Expand" or len(node.inputs) < 2:
            return False
        shapes = self.mapper.shapes
        fill = shapes.shape(node.inputs[0])
        if fill is None or any(dim != 1 for dim in fill):
            return False
        if self.index.constant_tensor(node.inputs[0]) is None:
            return False
        shape = shapes.shape(node.outputs[0]) or ()
        carrying = [at for at, dim in enumerate(shape) if carries_any(dim, self.mapper.sequences)]
        return carrying == [axis]

    def _broadcasts_a_table(self, producer: int, axis: int) -> bool:
        """Whether the walk goes on through ``producer``, which computes a tensor from shapes
        and constants alone: where asked (the extension's walk), an Expand of a table that
        holds ``axis`` already (not broadcast along it). Scattering the table instead of what
        the Expand makes of it sends less, by the factor the Expand broadcasts by (DeBERTa
        expands its relative positions [1, 1, S, S] over batch and heads), and the Expand runs
        on the slice, given its lengths by the extension's shard. A table of size 1 on the axis
        has no slices: GPT-OSS expands its sinks [1, heads, 1, 1] along the queries."""
        if not self.through_broadcasts:
            return False
        node = self.index.nodes[producer]
        if node.op_type != "Expand":
            return False
        mapped = self.mapper.input_axes(node, axis)
        if not mapped:
            return False
        name, at = mapped[0]
        shape = self.mapper.shapes.shape(name)
        return name == node.inputs[0] and shape is not None and at < len(shape) and shape[at] != 1


@dataclass(frozen=True)
class Region:
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
    ) -> Region:
        """A region given by name, with nothing read beside the walk."""
        return cls(tensors, nodes, cut, ids.flags(tensors), [ids.id[name] for name in cut])
