"""Graph outputs that expose what ranks would hold slices of (HF ``output_hidden_states`` and
``output_attentions``, Q given out, an input passed straight to an output).

A graph output is what every rank gives out whole. In the Polygraphy format, gathering a tensor
hands all its consumers the whole sequence, so:

- a tensor the walk back reaches (a hidden state between layers, an input) is computed whole:
  the cut moves past it to its consumers;
- a layer's Q or inside (its scores, its probabilities) is gathered where it is given out (Q
  left unscattered where it is a cut): the layer computes whole from there on, its output is
  whole on every rank, and what reads that output beside a slice needs the slice whole too.

The extension instead gathers each of them for the graph output alone
(``gathered_for_output``): the ranks keep computing on their slices.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.frontier.gathers import gathered_kv
from shardcheck.frontier.region import Region
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.ops import SHAPE_OPS


def exposed_in_region(index: GraphIndex, region: Region, seeds: set[str]) -> set[str]:
    """The graph outputs among the tensors of ``region`` other than the walk's ``seeds`` (a
    layer's Q is handled with its layer, below): to be computed whole."""
    return {name for name in index.graph_outputs if name in region.tensors and name not in seeds}


def passed_through(index: GraphIndex, shapes: ShapeInference, seq: object) -> list[tuple[str, int]]:
    """The graph outputs that copy a tensor (an Identity: an input given out as it came in),
    with their one sequence axis: the extension walks back from them too, so that the ranks
    copy their slices, gathered for the graph output, and the copied tensor can be a cut."""
    found = []
    for name in index.graph_outputs:
        producer = index.producer_of(name)
        if producer is None or producer.op_type != "Identity":
            continue
        axes = [axis for axis, dim in enumerate(shapes.shape(name) or ()) if dim == seq]
        if len(axes) == 1:
            found.append((name, axes[0]))
    return found


def gathered_for_output(
    index: GraphIndex, region: Region, seeds: set[str], exposed: ExposedLayers
) -> dict[str, int]:
    """The extension's graph outputs that ranks hold slices of, with their axes: the region's
    (on the axis the walk gave them) and the layers' exposed insides (``exposed``, found with
    ``first_only`` False). Each is gathered for the graph output alone, so none is whole."""
    found = {
        name: region.tensors[name]
        for name in exposed_in_region(index, region, seeds)
        if name not in exposed.points
    }
    found.update(exposed.points)
    return found


@dataclass
class ExposedLayers:
    """The layers whose Q or inside is a graph output: where each is given out (``points``,
    with the axis its queries are on), and their outputs, whole on every rank."""

    points: dict[str, int] = field(default_factory=dict)
    outputs: set[str] = field(default_factory=set)
    queries: set[str] = field(default_factory=set)

    def read_beside(
        self, index: GraphIndex, layers: list[AttentionLayer], region: Region
    ) -> set[str]:
        """The region's tensors that a node after an exposed layer reads beside its whole
        output (the residual stream added to it): each rank would add a slice to the whole."""
        needed: set[str] = set()
        if not self.outputs:
            return needed
        stops = gathered_kv(layers)
        queue = deque(self.outputs)
        seen = set(self.outputs)
        while queue:
            tensor = queue.popleft()
            for consumer in index.consumers_of(tensor):
                if consumer.op_type in SHAPE_OPS:
                    continue
                needed.update(name for name in consumer.inputs if name in region.tensors)
                for output in consumer.outputs:
                    if output and output not in seen and output not in region.tensors:
                        if output not in stops:
                            seen.add(output)
                            queue.append(output)
        return needed


def exposed_layers(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    *,
    first_only: bool = True,
) -> ExposedLayers:
    """Which layers give out their Q or a tensor inside them as a graph output; with
    ``first_only`` False, each of them (gathered for the graph output alone, none makes the
    layer whole)."""
    found = ExposedLayers()
    given_out = set(index.graph_outputs)
    for layer in layers:
        if layer.packed or layer.q_axis is None:
            continue
        points: dict[str, int] = {}
        if layer.q in given_out:
            points[layer.q] = layer.q_axis
        for node_index in layer.internal:
            for output in index.nodes[node_index].outputs:
                rank = shapes.rank(output)
                if output in given_out and output != layer.output and rank and rank >= 2:
                    points[output] = rank - 2
        if first_only:
            points = _first_given_out(index, layer, points)
        if points:
            found.points.update(points)
            found.outputs.add(layer.output)
            if layer.q in points:
                found.queries.add(layer.q)
    return found


def _first_given_out(
    index: GraphIndex, layer: AttentionLayer, points: dict[str, int]
) -> dict[str, int]:
    """``points`` without those computed inside ``layer`` from another of them: once one is
    gathered, what the layer computes from it is whole (the probabilities from gathered
    scores), and gathering it again would join whole copies."""
    inside = set(layer.internal)
    kept: dict[str, int] = {}
    for point, axis in points.items():
        others = set(points) - {point}
        pending, seen = [point], {point}
        from_another = False
        while pending and not from_another:
            producer = index.producer_of(pending.pop())
            if producer is None or producer.index not in inside:
                continue
            for name in producer.inputs:
                if name in others:
                    from_another = True
                elif name and name not in seen:
                    seen.add(name)
                    pending.append(name)
        if not from_another:
            kept[point] = axis
    return kept
