"""The extension's traced lengths: Reshapes that hold the length TorchScript traced the model at.

TorchScript's tracing writes the length it ran at into the target shape of some Reshapes
(nn.MultiheadAttention's head splits of K and V; analysis/baked.py finds them), so the model
runs at that length only, and in Polygraphy's multi-device model no rank's slice may reach
them: the cut moves inside each layer, and the projections run whole. The extension names
them (``traced_length``). ``shardcheck shard`` first computes the entry of each one's target
that holds the traced length from the Reshape's own input (its length on the sequence axis):
on one device that is the traced length, so the model computes what it did, and on a rank it
is the rank's length. The plan is then found and carried out on that model, as on an export
that kept the length symbolic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shardcheck.analysis.baked import baked_lengths
from shardcheck.analysis.detect import AttentionLayer, detect_attention, sequence_dims
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import HintsMismatchError
from shardcheck.graph import build, protos
from shardcheck.graph.index import Dim, GraphIndex, Node

# What the nodes that compute a traced entry are named after: the Reshape's name, then this.
NAME_PART = "/shardcheck_traced_length"
# Slice's end for "to the last entry" (ONNX clamps it to the length).
TO_THE_END = 2**62


@dataclass(frozen=True)
class TracedEntry:
    """Entry ``entry`` of a Reshape's target (of ``size`` entries) holds ``factor`` times the
    traced length, which its input carries on ``input_axis``."""

    entry: int
    size: int
    input_axis: int
    factor: int


def traced_entries(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> dict[str, TracedEntry] | None:
    """The Reshapes that hold a traced length of the layers' sequence dims, by name, with the
    entry of their target that holds it; None where one of them has no such entry alone of
    its kind (a length merged with another dim on its input, two entries a multiple of it):
    that Reshape cannot be given a rank's length, so the model runs at the traced length
    only."""
    found: dict[str, TracedEntry] = {}
    for seq in sequence_dims(shapes, layers):
        for node, length in baked_lengths(index, shapes, seq):
            entry = _entry(shapes, node, length, seq)
            if entry is None or not node.name or node.name in found:
                return None
            found[node.name] = entry
    return found


def _entry(shapes: ShapeInference, node: Node, length: int, seq: Dim) -> TracedEntry | None:
    source, target = shapes.shape(node.inputs[0]), shapes.shape(node.outputs[0])
    if source is None or target is None or len(node.inputs) < 2:
        return None
    axes = [axis for axis, dim in enumerate(source) if dim == seq]
    exact = [at for at, dim in enumerate(target) if dim == length]
    multiples = [
        at for at, dim in enumerate(target) if isinstance(dim, int) and dim and dim % length == 0
    ]
    entries = exact if len(exact) == 1 else multiples
    if len(axes) != 1 or len(entries) != 1:
        return None
    at = entries[0]
    return TracedEntry(at, len(target), axes[0], target[at] // length)  # type: ignore[operator]


def untraced_model(index: GraphIndex, entries: Mapping[str, TracedEntry]) -> protos.ModelProto:
    """A copy of the model in which each Reshape of ``entries`` computes its traced entry from
    its input's length; at the traced length it computes what the model does."""
    model = protos.ModelProto()
    model.CopyFrom(index.model)
    by_name = {node.name: node for node in index.nodes if node.name in entries}
    inserted: dict[int, list[protos.NodeProto]] = {}
    graph = model.graph
    for name, entry in entries.items():
        node = by_name[name]
        nodes, target = _entry_nodes(node, entry, build.onnx_opset(model))
        inserted[node.index] = nodes
        graph.node[node.index].input[1] = target
    kept = list(graph.node)
    del graph.node[:]
    for at, proto in enumerate(kept):
        graph.node.extend(inserted.get(at, ()))
        graph.node.append(proto)
    return model


def _entry_nodes(node: Node, entry: TracedEntry, opset: int) -> tuple[list[protos.NodeProto], str]:
    """The nodes that compute ``node``'s target with the traced entry read from its input,
    and the new target's name."""
    prefix = node.name + NAME_PART
    target = node.inputs[1]
    length = f"{prefix}/length"
    nodes = build.dim_nodes(node.inputs[0], entry.input_axis, length, f"{prefix}/Shape", opset)
    if entry.factor != 1:
        factor = f"{prefix}/factor"
        nodes.append(_constant(factor, [entry.factor]))
        nodes.append(
            build.make_node("Mul", [length, factor], [f"{prefix}/entry"], name=f"{prefix}/Mul")
        )
        length = f"{prefix}/entry"
    parts = []
    if entry.entry > 0:
        parts.append(_slice(nodes, prefix, "head", target, 0, entry.entry))
    parts.append(length)
    if entry.entry < entry.size - 1:
        parts.append(_slice(nodes, prefix, "tail", target, entry.entry + 1, TO_THE_END))
    new_target = f"{prefix}/target"
    nodes.append(build.make_node("Concat", parts, [new_target], name=f"{prefix}/Concat", axis=0))
    return nodes, new_target


def _slice(
    nodes: list[protos.NodeProto], prefix: str, part: str, target: str, start: int, end: int
) -> str:
    starts, ends, output = f"{prefix}/{part}_start", f"{prefix}/{part}_end", f"{prefix}/{part}"
    nodes.append(_constant(starts, [start]))
    nodes.append(_constant(ends, [end]))
    nodes.append(
        build.make_node("Slice", [target, starts, ends], [output], name=f"{prefix}/Slice_{part}")
    )
    return output


def _constant(name: str, values: list[int]) -> protos.NodeProto:
    value = build.int64_tensor(name, [len(values)], values)
    return build.make_node("Constant", [], [name], name=name, value=value)


@dataclass(frozen=True)
class Untraced:
    """The model with its traced Reshapes (``traced``) reading their input's length: its
    index, shapes and layers, on which gen finds the extension's plan."""

    index: GraphIndex
    shapes: ShapeInference
    layers: list[AttentionLayer]
    traced: tuple[str, ...]


def untraced(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> Untraced | None:
    """The model with every traced Reshape reading its input's length; None where one cannot
    (``traced_entries``) or there is none."""
    entries = traced_entries(index, shapes, layers)
    if not entries:
        return None
    model = GraphIndex(untraced_model(index, entries), index.source)
    model_shapes = ShapeInference(model)
    return Untraced(model, model_shapes, detect_attention(model, model_shapes), tuple(entries))


def untraced_index(
    index: GraphIndex, names: Iterable[str], hints_source: str, shapes: ShapeInference | None
) -> GraphIndex:
    """The index of the model with the traced Reshapes ``names`` (an extension's
    ``traced_length``) reading their input's length; HintsMismatchError where one is not a
    Reshape that holds the traced length, alone of its kind, in this model."""
    shapes = shapes if shapes is not None else ShapeInference(index)
    entries = traced_entries(index, shapes, detect_attention(index, shapes)) or {}
    wanted = list(names)
    for name in wanted:
        if name not in entries:
            raise HintsMismatchError(
                f"{hints_source}: traced_length: {name!r} is not a Reshape of this model that "
                "holds the length it was traced at; regenerate the extension with 'shardcheck "
                "gen' for this model"
            )
    return GraphIndex(untraced_model(index, {name: entries[name] for name in wanted}), index.source)
