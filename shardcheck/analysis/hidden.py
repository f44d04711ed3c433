"""Attention that detection does not search: inside If, Loop and Scan bodies, and inside the
model-local functions the graph calls.

The hints format names tensors of the main graph only: Polygraphy's ``multi-device shard``
reads ``graph.tensors()`` of onnx-graphsurgeon's main graph, which holds no tensor of a
subgraph or of a function body, and matches its attention patterns on the main graph's nodes.
So no hint can scatter, gather or name a layer there; such a model is reported (gen warns,
verify fails), with the places and what to do, rather than sharded as if it had no attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardcheck.graph import protos
from shardcheck.graph.ops import fused_attention_inputs
from shardcheck.wording import counted

# What gen and verify say to do, by where the attention is.
INLINE_FUNCTIONS = (
    "inline the model-local functions before gen (onnx.inliner.inline_local_functions(model)), "
    "or export without them (no export_modules_as_functions)"
)
UNROLL_CONTROL_FLOW = (
    "export the control flow (If, Loop, Scan) unrolled, as tracing one fixed path does"
)


@dataclass(frozen=True)
class HiddenAttention:
    """Attention-like nodes (Softmax, a fused attention op) in one place detection skips."""

    place: str  # e.g. "the body of Loop node 'loop'", "model-local function 'pkg.Attn'"
    softmaxes: int
    fused: int
    in_function: bool

    @property
    def count(self) -> int:
        return self.softmaxes + self.fused


def hidden_attention(model: protos.ModelProto) -> list[HiddenAttention]:
    """Each subgraph (If, Loop, Scan body, at any depth) and each model-local function the
    graph reaches that holds a Softmax or a fused attention node, in graph order."""
    functions = {(f.domain, f.name): f for f in model.functions}
    calls: dict[tuple[str, str], list[str]] = {}
    # Where each holding place is: a subgraph's description, or a function's key (its place
    # names its calls, all known once the graph is walked).
    found: list[tuple[str | tuple[str, str], int, int, bool]] = []

    def scan(
        nodes: Iterable[protos.NodeProto], where: str | tuple[str, str] | None, in_function: bool
    ) -> None:
        softmaxes = fused = 0
        for node in nodes:
            if node.op_type == "Softmax":
                softmaxes += 1
            elif fused_attention_inputs(node.domain, node.op_type) is not None:
                fused += 1
            key = (node.domain, node.op_type)
            if key in functions:
                calls.setdefault(key, []).append(node.name or node.output[0])
                if len(calls[key]) == 1:
                    scan(functions[key].node, key, True)
            for attribute in node.attribute:
                bodies = [attribute.g] if attribute.type == protos.AttributeProto.GRAPH else []
                if attribute.type == protos.AttributeProto.GRAPHS:
                    bodies = list(attribute.graphs)
                for body in bodies:
                    named = node.name or node.output[0]
                    scan(
                        body.node,
                        f"the {attribute.name} of {node.op_type} node '{named}'",
                        in_function,
                    )
        if where is not None and softmaxes + fused:
            found.append((where, softmaxes, fused, in_function))

    scan(model.graph.node, None, False)
    return [
        HiddenAttention(
            where if isinstance(where, str) else _function_place(where, calls[where]),
            softmaxes,
            fused,
            in_function,
        )
        for where, softmaxes, fused, in_function in found
    ]


def _function_place(key: tuple[str, str], callers: list[str]) -> str:
    domain, name = key
    called = f"called by node '{callers[0]}'"
    if len(callers) > 1:
        called = f"called by {len(callers)} nodes, first '{callers[0]}'"
    return f"model-local function '{domain + '.' if domain else ''}{name}' ({called})"


def what_to_do(hidden: list[HiddenAttention]) -> str:
    """What makes the attention of ``hidden`` something hints can name."""
    steps = [INLINE_FUNCTIONS] if any(item.in_function for item in hidden) else []
    if any(item.place.startswith("the ") for item in hidden):
        steps.append(UNROLL_CONTROL_FLOW)
    return " and ".join(steps) + "; the hints format names only tensors of the main graph"


def describe(hidden: list[HiddenAttention]) -> str:
    """The places, each with what it holds: one clause for a message."""
    parts = []
    for item in hidden:
        held = [counted(item.softmaxes, "Softmax", "Softmaxes")] if item.softmaxes else []
        if item.fused:
            held.append(counted(item.fused, "fused attention node"))
        parts.append(f"{item.place}: {' and '.join(held)}")
    return "; ".join(parts)
