"""shard's fused replacements (``cp-type fused``): which nodes each hinted layer's Attention
replaces, the attributes it carries, and the sweep of what the replaced nodes alone read.

As Polygraphy 0.53.6's ``_make_fused_attention``: an ``Attention`` node (default domain) with
``is_causal``, ``scale``, ``TRT_decomposable=0`` and ``nb_rank``, in that order, reading Q, K
and V through a Transpose by each shuffle given; its output is the layer's, under the same name.
The hinted inputs are still reduce-scattered and the hinted outputs all-gathered; the op
gathers K and V across the ranks itself. Unlike Polygraphy, ``scale`` is the one the replaced
nodes apply (``analysis.fusion``), and every layer shardcheck detects can be replaced.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.fusion import FusedSite, fused_site, pattern1_layers
from shardcheck.errors import HintsMismatchError
from shardcheck.graph import build, protos
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.tensors import attribute_graphs
from shardcheck.hints.model import FusedAttention, ShardHints

FUSED_OP = "Attention"


def fused_attention_attributes(
    fused: FusedAttention, scale: float | None
) -> list[protos.AttributeProto]:
    """The attributes of the fused Attention, in Polygraphy's order."""
    return [
        build.make_attribute("is_causal", int(fused.is_causal)),
        build.make_attribute("scale", float(1.0 if scale is None else scale)),
        build.make_attribute("TRT_decomposable", 0),
        build.make_attribute("nb_rank", int(fused.nb_rank)),
    ]


def is_fused_attention(node: protos.NodeProto) -> bool:
    """Whether ``node`` is the multi-device Attention a fused replacement writes."""
    return (
        node.op_type == FUSED_OP
        and node.domain in ("", "ai.onnx")
        and any(attribute.name == "nb_rank" for attribute in node.attribute)
    )


def fused_sites(
    index: GraphIndex,
    hints: ShardHints,
    detected: list[AttentionLayer],
    hints_source: str,
) -> dict[int, FusedSite]:
    """Position of each hinted layer with ``replace`` -> what its Attention replaces;
    HintsMismatchError for a Q that is no layer's, or a layer that is no fused attention."""
    by_q: dict[str, AttentionLayer] = {}
    for layer in detected:
        by_q.setdefault(layer.q, layer)
    fused = [hint.q for hint in hints.attention_layers if hint.replace is not None]
    # Polygraphy's pattern 1 names a layer by its Q before the scale.
    pattern1 = pattern1_layers(index, (q for q in fused if q not in by_q), detected)
    sites: dict[int, FusedSite] = {}
    for position, hint in enumerate(hints.attention_layers):
        if hint.replace is None:
            continue
        where = f"{hints_source}: attention_layers[{position}] (q {hint.q!r})"
        layer, match = by_q.get(hint.q), None
        if layer is None and hint.q in pattern1:
            layer, match = pattern1[hint.q]
        if layer is None:
            raise HintsMismatchError(
                f"{where}: q {hint.q!r} is not the Q of any attention layer of the model"
            )
        site = fused_site(index, layer, match)
        if site.problem or site.scale is None:
            problem = site.problem or "the scale it applies is not a constant"
            raise HintsMismatchError(
                f"{where}: layer {layer.name}: {problem}, so no fused Attention can replace "
                "it; hint it native (replace: null)"
            )
        sites[position] = site
    return sites


def live_nodes(nodes: list[protos.NodeProto], outputs: Iterable[str]) -> list[protos.NodeProto]:
    """``nodes`` (in a topological order) but those no graph output depends on."""
    needed = set(outputs)
    kept: list[protos.NodeProto] = []
    for node in reversed(nodes):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(name for name in node.input if name)
            for attribute in node.attribute:
                for graph in attribute_graphs(attribute):
                    needed.update(name for inner in graph.node for name in inner.input)
    kept.reverse()
    return kept
