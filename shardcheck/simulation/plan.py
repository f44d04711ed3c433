"""The simulation's plan: a sharded model cut into stages at its ``DistCollective`` nodes.

A node's stage is the number of collectives on its longest path from the graph inputs, but for
the work on weights alone (a weight's Transpose), done in the stage that reads it, and the
``Constant`` nodes, copied into each stage that reads them. The plan is the stages and the
collectives between them, in the order they run; a stage becomes a model of its own
(``stage_model``) for its onnxruntime session.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx
from onnx import helper

from shardcheck.graph.ops import is_default_domain
from shardcheck.graph.tensors import attribute_graphs
from shardcheck.simulation.collectives import CollectiveStep, collective_step, is_collective
from shardcheck.simulation.fused_attention import FusedAttentionStep

if TYPE_CHECKING:
    from shardcheck.simulation.ahead import AheadSession


@dataclass
class Stage:
    """Nodes between collectives, run as one model; ``sessions``: its onnxruntime sessions, by
    the nodes left out and whether every tensor is an output (the diagnostic pass)."""

    level: int
    nodes: list[onnx.NodeProto]
    reads: list[list[str]]  # each node's inputs (``_node_inputs``), in the order of ``nodes``
    inputs: list[str]
    outputs: list[str]  # what later stages, collectives or the graph outputs read
    produced: list[str]  # every tensor the stage makes (the diagnostic outputs)
    sessions: dict[tuple[frozenset[str], bool], Any] = field(default_factory=dict)
    ahead: AheadSession | None = None
    # Of a stage that shares its leader's session (``ahead``): the weights fed as inputs.
    leader: Stage | None = None
    lifted: tuple[str, ...] = ()


def plan_steps(
    nodes: list[onnx.NodeProto],
    reads: list[list[str]],
    weights: Collection[str],
    graph_inputs: set[str],
    graph_outputs: list[str],
) -> list[Stage | CollectiveStep | FusedAttentionStep]:
    """The stages and collectives of ``nodes`` (in a topological order; ``reads``: what each
    reads), in the order they run. ``weights``: the names of the initializers."""
    return _Planner(nodes, reads, weights).plan(graph_inputs, graph_outputs)


class _Planner:
    def __init__(
        self, nodes: list[onnx.NodeProto], reads: list[list[str]], weights: Collection[str]
    ) -> None:
        self.nodes = nodes
        self.reads = reads
        self.weights = weights

    def plan(
        self, graph_inputs: set[str], graph_outputs: list[str]
    ) -> list[Stage | CollectiveStep | FusedAttentionStep]:
        collective = [is_collective(node) for node in self.nodes]
        level = dict.fromkeys(set(self.weights) | graph_inputs, 0)
        level_of = level.get
        node_levels: list[int] = []
        for node, reads, gathers in zip(self.nodes, self.reads, collective, strict=True):
            at = 0
            for name in reads:
                here = level_of(name, 0)
                if here > at:
                    at = here
            node_levels.append(at)
            for name in node.output:
                level[name] = at + 1 if gathers else at
        read_at: dict[str, float] = dict.fromkeys(graph_outputs, float("inf"))
        # What stays where it is made: the graph's outputs and what the collectives read.
        kept = set(graph_outputs).union(
            *(reads for reads, gathers in zip(self.reads, collective, strict=True) if gathers)
        )
        copied = self._copied_constants(kept)
        placed_in_readers = set(copied.values())
        self._defer_weight_work(node_levels, collective, kept, copied, placed_in_readers)
        # The nodes of each level, in order (one pass: a model has hundreds of levels).
        by_level: list[list[int]] = [[] for _ in range(max(node_levels, default=0) + 1)]
        for position, at in enumerate(node_levels):
            if position in placed_in_readers:
                continue
            by_level[at].append(position)
            # A collective reads its input after the stage of its level has run.
            reader = at + 0.5 if collective[position] else at
            for name in self.reads[position]:
                if read_at.get(name, -1.0) < reader:
                    read_at[name] = reader

        steps: list[Stage | CollectiveStep | FusedAttentionStep] = []
        for at, here in enumerate(by_level):
            members = [i for i in here if not collective[i]]
            if members:
                steps.append(self._stage(at, members, read_at, copied))
            steps.extend(collective_step(self.nodes[i]) for i in here if collective[i])
        return steps

    def _defer_weight_work(
        self,
        node_levels: list[int],
        collective: list[bool],
        kept: set[str],
        copied: dict[str, int],
        copies: set[int],
    ) -> None:
        """Move the nodes computed from weights and constants alone (a weight's Transpose)
        to the stage of their first reader: the first stage would otherwise compute every
        layer's and hand them all on, holding a copy of the weights for the whole run (and
        the layers' stages, computing their own, are of one form). Not those whose outputs
        are ``kept``. ``copies``: the positions of the ``copied`` constants. ``node_levels`` is
        changed in place."""
        static = set(self.weights).union(copied, [""])  # "": an optional input left out
        movable: list[int] = []  # in order
        for position, reads in enumerate(self.reads):
            if not collective[position] and static.issuperset(reads):
                static.update(self.nodes[position].output)
                if position not in copies:
                    movable.append(position)
        first_read: dict[str, int] = {}  # static tensor -> the lowest level of a stage reading it
        for position in range(len(self.nodes) - 1, -1, -1):
            if collective[position]:
                continue
            at = node_levels[position]
            if movable and movable[-1] == position:
                movable.pop()
                outputs = [name for name in self.nodes[position].output if name]
                if kept.isdisjoint(outputs):
                    later = min(
                        (first_read[name] for name in outputs if name in first_read), default=at
                    )
                    node_levels[position] = at = max(at, later)
            for name in self.reads[position]:
                if name in static and first_read.get(name, at + 1) > at:
                    first_read[name] = at

    def _copied_constants(self, kept: set[str]) -> dict[str, int]:
        """Constant nodes copied into each stage that reads them, by output: the first stage
        would otherwise compute every layer's constants and hand them on, and the layers'
        stages, holding their own, are of one form (stage_forms.py). Not those whose output
        is ``kept``."""
        return {
            node.output[0]: position
            for position, node in enumerate(self.nodes)
            if _is_constant(node)
            and len(node.output) == 1
            and node.output[0]
            and node.output[0] not in kept
        }

    def _stage(
        self, at: int, members: list[int], read_at: dict[str, float], copied: dict[str, int]
    ) -> Stage:
        constants = {
            copied[name]: None for i in members for name in self.reads[i] if name in copied
        }
        order = [*constants, *members]  # constants read no tensor: first is in order
        nodes = [self.nodes[i] for i in order]
        reads = [self.reads[i] for i in order]
        produced = [name for node in nodes for name in node.output if name]
        made = set(produced)
        inputs: dict[str, None] = {}
        for names in reads:
            for name in names:
                if name and name not in made and name not in self.weights:
                    inputs.setdefault(name)
        outputs = [name for name in produced if read_at.get(name, -1.0) > at and name not in copied]
        return Stage(at, nodes, reads, list(inputs), outputs, produced)


def stage_model(
    stage: Stage,
    removed: frozenset[str],
    declared: Mapping[str, tuple[int, int | None]],
    outputs: list[str],
    template: onnx.ModelProto,
    weights: Mapping[str, onnx.TensorProto],
    lifted: tuple[str, ...] = (),
) -> onnx.ModelProto:
    """The stage as a model, but for its ``removed`` nodes, returning ``outputs``.
    ``declared``: each input's element type and rank (None: any rank); ``template``: the
    single-device model, whose opsets and functions it takes, and whose ``weights`` (by name)
    it reads; ``lifted``: weights that are inputs instead of initializers."""
    kept = [i for i, node in enumerate(stage.nodes) if node.name not in removed]
    nodes = [stage.nodes[i] for i in kept]
    used = {name for i in kept for name in stage.reads[i]}
    inputs = []
    for name in stage.inputs:
        elem, ndim = declared[name]
        shape = None if ndim is None else [None] * ndim
        inputs.append(helper.make_tensor_value_info(name, elem, shape))
    for name in lifted:
        weight = weights[name]
        inputs.append(helper.make_tensor_value_info(name, weight.data_type, weight.dims))
    graph = helper.make_graph(
        nodes,
        f"stage_{stage.level}",
        inputs,
        [untyped_output(name) for name in outputs],
        [weights[name] for name in sorted(used.intersection(weights) - set(lifted))],
    )
    model = helper.make_model(
        graph,
        opset_imports=list(template.opset_import),
        ir_version=template.ir_version,
    )
    model.functions.extend(template.functions)
    return model


def untyped_output(name: str) -> onnx.ValueInfoProto:
    """A graph output without type; onnxruntime infers it."""
    info = onnx.ValueInfoProto()
    info.name = name
    return info


def toposorted(graph: onnx.GraphProto) -> tuple[list[onnx.NodeProto], list[list[str]]]:
    """The nodes in a topological order (the graph's own where it is one), and what each
    reads (``_node_inputs``). An unnamed node is replaced by a named copy, so that
    onnxruntime's errors can point at it."""
    nodes: list[onnx.NodeProto] = []
    for position, proto in enumerate(graph.node):
        if not proto.name:
            named = onnx.NodeProto()
            named.CopyFrom(proto)
            named.name = f"<unnamed {proto.op_type} #{position}>"
            proto = named
        nodes.append(proto)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    reads = [_node_inputs(node) for node in nodes]
    if all(
        producer.get(name, -1) < position for position, names in enumerate(reads) for name in names
    ):
        return nodes, reads
    order: list[int] = []
    placed: set[int] = set()
    visiting: set[int] = set()
    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            position, inputs_placed = stack.pop()
            if inputs_placed:
                placed.add(position)
                order.append(position)
                continue
            if position in placed or position in visiting:
                continue
            visiting.add(position)
            stack.append((position, True))
            for name in reversed(reads[position]):
                before = producer.get(name)
                if before is not None and before not in placed:
                    stack.append((before, False))
    return [nodes[i] for i in order], [reads[i] for i in order]


def _node_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of a node, with the outer tensors its subgraphs (If, Loop, Scan) read."""
    names = node.input[:]
    for attribute in node.attribute:
        for graph in attribute_graphs(attribute):
            local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
            for inner in graph.node:
                names.extend(n for n in _node_inputs(inner) if n and n not in local)
                local.update(inner.output)
    return names


def downstream(nodes: Iterable[onnx.NodeProto], start: str) -> frozenset[str]:
    """The names of ``start`` and of every node of ``nodes`` that depends on it."""
    removed = {start}
    tainted: set[str] = set()
    for node in nodes:
        if node.name in removed or any(name in tainted for name in _node_inputs(node)):
            removed.add(node.name)
            tainted.update(node.output)
    return frozenset(removed)


def _is_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and is_default_domain(node.domain)
