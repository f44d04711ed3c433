"""The graph walks behind verify's runtime checks: which tensors the runs watch, which sides of
attention each input reaches, and where a hinted axis goes on its way to the masks."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer, sequence_dims
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.ops import SHAPE_OPS
from shardcheck.hints.model import ShardHints, ShardTensor


@dataclass
class Walks:
    """What the comparison needs of the graph: the attention inputs, what each unhinted graph
    input reaches, and the hinted tensors that reach only masks."""

    query: set[str]
    key: set[str]
    masks: set[str]
    input_reach: dict[str, set[str]] = field(default_factory=dict)
    # Each hinted tensor that reaches only masks, with those masks and the axes of theirs
    # that its hinted axis becomes (where it can be followed).
    mask_only: list[tuple[ShardTensor, list[str], dict[str, set[int]]]] = field(
        default_factory=list
    )


class AxesToMasks:
    """Follows axes forward to the masks. One AxisMapper serves every walk, so that what it
    memoises is kept; it is made on the first walk that needs it."""

    def __init__(
        self, index: GraphIndex, shapes: ShapeInference | None, layers: Iterable[AttentionLayer]
    ) -> None:
        self.index = index
        self.shapes = shapes
        self.layers = list(layers)
        self._mapper: AxisMapper | None = None

    def reached(
        self, starts: list[tuple[str, int]], masks: set[str], stop: set[str] | None = None
    ) -> dict[str, set[int]]:
        """The axes of ``masks`` that the axes ``starts`` (tensor, axis) become, followed
        forward through the ops that map them, not past ``stop`` (none where an op in between
        merges the axis with another, as TorchScript's BERT flattens its padding mask)."""
        if self.shapes is None:
            return {}
        if self._mapper is None:
            seq, *others = sequence_dims(self.shapes, self.layers)
            self._mapper = AxisMapper(self.index, self.shapes, seq, others)
        mapper = self._mapper
        queue, seen = deque(starts), set(starts)
        reached: dict[str, set[int]] = {}
        while queue:
            name, axis = queue.popleft()
            if name in masks:
                reached.setdefault(name, set()).add(axis)
                continue
            if stop is not None and name in stop:
                continue
            for node in self.index.consumers_of(name):
                output = node.outputs[0] if node.outputs else ""
                if not output or node.op_type in SHAPE_OPS:
                    continue
                out_axis = mapper.output_axis(node, name, axis)
                if out_axis is not None and (output, out_axis) not in seen:
                    seen.add((output, out_axis))
                    queue.append((output, out_axis))
        return reached


def graph_walks(
    index: GraphIndex,
    hints: ShardHints,
    by_q: dict[str, AttentionLayer],
    axes: AxesToMasks,
) -> Walks:
    """The walks of the comparison, made once before the runs."""
    query, key, masks = _attention_sides(index, by_q, hints)
    ends = query | key | masks
    hinted = {t.name for t in hints.inputs}
    # A fused attention node is reached through its Q, K and V, never past it from a mask
    # over the keys it reads: that mask does not make the next layer's Q.
    fused = {layer.output for layer in by_q.values() if layer.kind == "fused"}
    walks = Walks(query, key, masks)
    for name in index.graph_inputs:
        if name not in hinted:
            # Through data only, up to the attention inputs.
            walks.input_reach[name] = index.computed_from(
                [name], stop=hinted | fused, ends=ends, through_shapes=False
            )
    # Nearly every hinted tensor feeds Q, K or V: find those in one walk back, and follow
    # only the others forward.
    feeds_attention = _upstream(index, query | key, ends)
    for tensor in hints.inputs:
        if not index.has_tensor(tensor.name) or tensor.name in feeds_attention:
            continue
        reached = index.computed_from([tensor.name], ends=ends, through_shapes=False)
        reached_masks = sorted(reached & masks)
        if reached_masks and not reached & (query | key):
            reached_axes = axes.reached([(tensor.name, tensor.seq_len_idx)], masks)
            walks.mask_only.append((tensor, reached_masks, reached_axes))
    return walks


def _attention_sides(
    index: GraphIndex, by_q: dict[str, AttentionLayer], hints: ShardHints
) -> tuple[set[str], set[str], set[str]]:
    """The layers' Q; their K and V; their masks, with what else a fused attention node reads
    beside Q, K and V from data (a mask over the keys: key_padding_mask, mask_index), which
    ends the walks as the masks do instead of leading through the node to the next layer."""
    layers = [by_q[h.q] for h in hints.attention_layers if h.q in by_q] or list(by_q.values())
    query = {layer.q for layer in layers}
    key = {layer.gathered_k for layer in layers} | {layer.gathered_v for layer in layers}
    masks = {m for layer in layers for m in layer.masks}
    for layer in layers:
        if layer.kind == "fused":
            node = index.nodes[layer.internal[0]]
            sides = {layer.q, layer.gathered_k, layer.gathered_v}
            masks.update(
                name
                for name in node.inputs
                if name and name not in sides and index.constant_tensor(name) is None
            )
    return query, key, masks


def _upstream(index: GraphIndex, targets: set[str], ends: set[str]) -> set[str]:
    """Every tensor from which ``computed_from`` (with these ``ends``, through data only)
    would reach a target: a walk back through data (not Shape), not going on past an end."""
    found = set(targets)
    queue = deque(targets)
    while queue:
        tensor = queue.popleft()
        producer = index.producer_of(tensor)
        if producer is None or producer.op_type in SHAPE_OPS:
            continue
        for name in producer.inputs:
            if name and name not in found:
                found.add(name)
                if name not in ends:
                    queue.append(name)
    return found


def watched_tensors(
    index: GraphIndex, hints: ShardHints, by_q: dict[str, AttentionLayer]
) -> dict[str, str]:
    """The tensors the runs expose and compare: tensor -> why it is watched (hint field)."""
    watched: dict[str, str] = {}
    for kind, tensors in (("inputs", hints.inputs), ("outputs", hints.outputs)):
        for t in tensors:
            if index.has_tensor(t.name):
                watched.setdefault(t.name, f"{kind}[name={t.name}]")
    for hint in hints.attention_layers:
        layer = by_q.get(hint.q)
        if layer is not None:
            watched.setdefault(layer.q, f"attention_layers[q={hint.q}]")
            watched.setdefault(layer.gathered_k, "k_seq_len_idx")
            watched.setdefault(layer.gathered_v, "v_seq_len_idx")
            for mask in layer.masks:
                watched.setdefault(mask, "mask")
    for name in index.graph_inputs:
        watched.setdefault(name, "graph input")
    return watched
