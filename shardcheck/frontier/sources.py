"""Shape sources: the tensors whose Shape a shape-like tensor (one computed from shapes and
constants alone) is computed from, and the nodes such a tensor sizes.

A node whose target shape (a Reshape's, an Expand's, a Slice's ends) comes from the Shape of a
tensor no rank slices gets that tensor's whole length: CP cannot cut before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.frontier.tensor_ids import TensorIds
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.graph.ops import SHAPE_OPS

_NO_SOURCES: frozenset[int] = frozenset()


class ShapeSources:
    """For a shape-like tensor (computed from shapes and constants), the tensors whose Shape
    it is computed from. Memoised, so the whole analysis stays linear; on tensor ids (see
    TensorIds), by name for the few questions asked by name."""

    def __init__(
        self,
        index: GraphIndex,
        ids: TensorIds,
        derived: set[str],
        shapes: ShapeInference | None = None,
    ) -> None:
        self.index = index
        self.ids = ids
        self.derived = derived
        self._value = shapes.value if shapes is not None else None
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
        if read >= 0 and self.derived_flags[read]:
            result = frozenset((read,))
        elif read >= 0:
            # The Shape of a shape-like tensor (a target shape made from other Shapes, as
            # GPT-OSS's sinks Expand reads): what sizes that tensor sizes this one.
            result = self.of_id(read)
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

    def sizes(self, node: Node, name: str) -> bool:
        """Whether input ``name`` of ``node`` may size it: not the repeats of a Tile where
        every one is a known integer, whatever Shapes they are computed from (a mixture of
        experts' [1, k, 1], read off the Shape of its TopK's indices), as Tile keeps every
        axis of repeat 1 whole."""
        if node.op_type != "Tile" or node.inputs[1:2] != (name,) or self._value is None:
            return True
        value = self._value(name)
        return value is None or not all(isinstance(v, int) for v in value)

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
                if name
                and name not in self.derived
                and name not in initializers
                and self.sizes(node, name)
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


def sized_by_whole(node: Node, sources: ShapeSources, region: set[str], reached: set[str]) -> bool:
    """Whether a shape-like input of ``node`` comes from the Shape of a tensor that no rank
    slices (in neither ``region`` nor ``reached``)."""
    return size_source_off_region(node, sources, region, reached) is not None


def size_source_off_region(
    node: Node,
    sources: ShapeSources,
    region: set[str],
    reached: frozenset[str] | set[str] = frozenset(),
) -> str | None:
    """The first tensor outside ``region`` and ``reached`` whose Shape a shape-like input of
    ``node`` is computed from, if any."""
    for name in node.inputs:
        # An input that is itself sliced (scattered, or computed from a slice) is no size.
        if (
            name
            and name not in sources.derived
            and name not in region
            and name not in reached
            and sources.sizes(node, name)
        ):
            for source in sorted(sources.of(name)):
                if source not in region and source not in reached:
                    return source
    return None


def shape_like_ancestors(
    index: GraphIndex, derived: set[str], starts: list[str], leave: Callable[[str], bool]
) -> Iterator[tuple[str, Node | None]]:
    """Back from ``starts`` through shape-like values (never data), each tensor once with its
    producer (None for a graph input or a weight), but those ``leave`` says hold no length
    that matters: the walk goes on through every producer but a Shape."""
    pending = [name for name in starts if name and name not in derived]
    seen = set(pending)
    while pending:
        tensor = pending.pop()
        if leave(tensor):
            continue
        producer = index.producer_of(tensor)
        yield tensor, producer
        if producer is None or producer.op_type in SHAPE_OPS:
            continue
        for name in producer.inputs:
            if name and name not in seen and name not in derived:
                seen.add(name)
                pending.append(name)
