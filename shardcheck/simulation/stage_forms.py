"""Stages of one form: stages of a simulation that differ only in the names of their tensors
and the values of their weights (a transformer's layers), so that one onnxruntime session can
serve them all.

A stage's form is its nodes (op type, domain, attributes) wired by position: each tensor is
known by when the stage first meets it (its inputs first, in their order), and each weight it
reads stands as one more input of its type and shape (the weight is *lifted*: the runs feed
its value, read from the model or mapped from its external file). Weights of types numpy has
no dtype of (bfloat16, the float8s, strings) are not lifted: they stay initializers of the
session, known by name, so stages reading different ones are of different forms. A stage
whose nodes hold subgraphs has no form (a subgraph reads outer tensors by name).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from shardcheck.graph import protos
from shardcheck.graph.tensors import attribute_graphs

_T = protos.TensorProto
LIFTED_TYPES = frozenset(
    (_T.FLOAT, _T.DOUBLE, _T.FLOAT16, _T.BOOL, _T.INT8, _T.INT16, _T.INT32, _T.INT64)
    + (_T.UINT8, _T.UINT16, _T.UINT32, _T.UINT64)
)


@dataclass(frozen=True)
class StageForm:
    """``key``: equal for stages of one form. ``lifted``: the weights the stage reads that are
    fed as inputs, in the order it first reads them (the same position in every stage of the
    form stands for the same input of the shared session)."""

    key: Hashable
    lifted: tuple[str, ...]


def stage_form(
    nodes: Sequence[protos.NodeProto],
    reads: Sequence[Sequence[str]],
    inputs: Sequence[str],
    input_types: Sequence[int],
    outputs: Sequence[str],
    weights: Mapping[str, protos.TensorProto],
) -> StageForm | None:
    """The form of the stage made of ``nodes`` (in order; ``reads``: what each reads), which
    takes ``inputs`` of ``input_types`` and hands on ``outputs``; None when it has none."""
    position = {name: at for at, name in enumerate(inputs)}
    position[""] = -1  # an optional input left out
    lifted: list[str] = []
    key: list[object] = [tuple(input_types)]
    for node, names in zip(nodes, reads, strict=True):
        wiring: list[object] = [node.op_type, node.domain]
        for name in names:
            at = position.get(name)
            if at is None:
                at = len(position)
                weight = weights.get(name)
                if weight is None:  # not read in order: no form to trust
                    return None
                if weight.data_type not in LIFTED_TYPES:
                    wiring.append(name)
                    continue
                position[name] = at
                lifted.append(name)
                wiring.append((weight.data_type, tuple(weight.dims)))
            wiring.append(at)
        for name in node.output:
            if name:
                position[name] = len(position)
        wiring.append(tuple(bool(name) for name in node.output))  # which outputs are made
        for attribute in node.attribute:
            if attribute_graphs(attribute):
                return None
            wiring.append(attribute.SerializeToString())
        key.append(tuple(wiring))
    key.append(tuple(position[name] for name in outputs))
    return StageForm(tuple(key), tuple(lifted))
