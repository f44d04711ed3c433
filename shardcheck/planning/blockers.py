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

from shardcheck.frontier.search import data_derived
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.graph.ops import SHAPE_OPS

MAX_WALK = 400
_MASK_OPS = frozenset("Trilu Less LessOrEqual Greater GreaterOrEqual Where".split())


@dataclass(frozen=True)
class Blocker:
    what: str  # "positions are computed from inputs_embeds.shape[1]"
    tensor: str
    node: str  # the Shape node that reads it
    fix: str


def find_blockers(
    index: GraphIndex, whole_projections: Iterable[Node], sliced: Callable[[str], bool]
) -> list[Blocker]:
    """The reasons, one per tensor whose length is read, for the projections run whole."""
    derived = data_derived(index)
    found: dict[str, Blocker] = {}
    for node in whole_projections:
        data = next((name for name in node.inputs if name in derived), None)
        if data is None:
            continue
        blocker = _earliest_length_read(index, data, derived, sliced)
        if blocker is not None:
            found.setdefault(blocker.tensor, blocker)
    return list(found.values())


def _earliest_length_read(
    index: GraphIndex, start: str, derived: set[str], sliced: Callable[[str], bool]
) -> Blocker | None:
    queue, seen = deque([start]), {start}
    earliest: Blocker | None = None
    while queue and len(seen) < MAX_WALK:
        tensor = queue.popleft()
        if sliced(tensor):
            continue
        reader = next((c for c in index.consumers_of(tensor) if c.op_type in SHAPE_OPS), None)
        if reader is not None:
            earliest = _blocker(index, tensor, reader)
        producer = index.producer_of(tensor)
        if producer is None or producer.op_type in SHAPE_OPS:
            continue
        for name in producer.inputs:
            if name and name in derived and name not in seen:
                seen.add(name)
                queue.append(name)
    return earliest


def _blocker(index: GraphIndex, tensor: str, reader: Node) -> Blocker:
    axis = _axis_read(index, reader)
    read = f"{tensor}.shape" + ("" if axis is None else f"[{axis}]")
    sized = _what_it_sizes(index, reader)
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


def _axis_read(index: GraphIndex, reader: Node) -> int | None:
    start = reader.attr("start")
    if start is not None and reader.attr("end") == start + 1:
        return int(start)
    for consumer in index.consumers_of(reader.outputs[0]):
        if consumer.op_type == "Gather" and len(consumer.inputs) > 1:
            value = index.constant_value(consumer.inputs[1])
            if value is not None and value.size == 1:
                return int(value.reshape(-1)[0])
    return None if start is None else int(start)


def _what_it_sizes(index: GraphIndex, reader: Node) -> str:
    queue, seen = deque(reader.outputs[:1]), set(reader.outputs[:1])
    kinds: set[str] = set()
    while queue and len(seen) < MAX_WALK:
        tensor = queue.popleft()
        for consumer in index.consumers_of(tensor):
            if consumer.op_type == "Range":
                kinds.add("positions")
            elif consumer.op_type in _MASK_OPS:
                kinds.add("mask")
            for name in consumer.outputs:
                if name and name not in seen:
                    seen.add(name)
                    queue.append(name)
    if "positions" in kinds:
        return "positions"
    return "mask" if "mask" in kinds else "shape"
