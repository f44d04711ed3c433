"""How an attention layer becomes one fused multi-device ``Attention`` (``--cp-type fused``).

TensorRT's multi-device attention is one ``Attention`` node with the attributes ``is_causal``,
``scale``, ``TRT_decomposable`` and ``nb_rank``; its Q, K and V are ``[batch, heads, seq,
head_dim]`` (the shuffles Transpose them there), and it applies no mask but a causal one. Here:

- ``fused_site``: what the node replaces in a layer: the tensors it reads, the tensor it makes,
  the nodes it stands for and the scale those nodes apply (what ``shard`` writes);
- ``fused_layout``: the shuffles and causality a layer needs, or why it cannot be fused at all
  (what ``gen`` infers and ``verify`` checks hints against).

Polygraphy 0.53.6 writes ``scale=1.0`` whatever the layer: right where the matched subgraph
holds no scale (pattern 0: ``MatMul -> Softmax -> MatMul``), wrong for pattern 1, whose scale
by ``Sqrt(1 / Sqrt(head_dim))`` on Q and K is inside the match. shardcheck writes the scale the
replaced nodes apply.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.polygraphy import PatternMatch, match_all
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex, Node
from shardcheck.graph.ops import MATMULS, SHAPE_OPS

POLYGRAPHY_SCALE = 1.0
# On the scores' way to the Softmax, these change neither values nor the fused op's meaning.
NEUTRAL_SCORE_OPS = frozenset(("Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze"))
MASK_OPS = frozenset(("Add", "Sub", "Where"))
NEUTRAL_PROBS_OPS = frozenset(("Cast", "Dropout", "Identity", "Reshape", "Squeeze", "Unsqueeze"))
FUSED_RANK = 4  # [batch, heads, seq, head_dim]
MAX_MASK_WALK = 200


@dataclass(frozen=True)
class FusedSite:
    """What one fused Attention replaces."""

    q: str  # the tensors it reads, before its shuffles
    k: str
    v: str
    output: str  # the tensor it makes: the layer's output, under the same name
    replaced: tuple[int, ...]  # indices of the nodes it stands for
    scale: float | None  # the scale those nodes apply to the scores; None: not constant
    problem: str = ""  # why these nodes are no fused attention ("" when they are)


@dataclass(frozen=True)
class FusedLayout:
    """The replacement a layer needs: its shuffles (None: the tensor is in place) and causality;
    ``problem`` says why it cannot be replaced ("" when it can)."""

    q_shuffle: tuple[int, ...] | None
    k_shuffle: tuple[int, ...] | None
    v_shuffle: tuple[int, ...] | None
    is_causal: bool
    problem: str = ""


def fused_site(
    index: GraphIndex, layer: AttentionLayer, match: PatternMatch | None = None
) -> FusedSite:
    """The nodes of ``layer`` a fused Attention replaces. With ``match`` (Polygraphy's pattern
    1, named by its Q), the Attention reads the pattern's Q and K, before its scale, as
    Polygraphy's does; otherwise the score MatMul's inputs and the context MatMul's V."""
    if layer.kind != "decomposed" or not layer.op_type.startswith("MatMul/"):
        return FusedSite(
            layer.q,
            layer.gathered_k,
            layer.gathered_v,
            layer.output,
            layer.internal,
            None,
            f"it is a {layer.op_type} layer; only MatMul/Softmax/MatMul layers are replaced",
        )
    nodes = [index.nodes[i] for i in layer.internal]
    scale, problem = _score_scale(index, layer, nodes)
    replaced = set(layer.internal)
    q, k = layer.q, layer.gathered_k
    if match is not None and match.pattern == 1:
        q, k = match.q, match.k
        for name in match.matmul1.inputs[:2]:
            producer = index.producer_of(name)
            if producer is not None:
                replaced.add(producer.index)
        scale = _pattern1_scale(index, match)
        problem = problem or ("" if scale is not None else "its head_dim is not known")
    return FusedSite(q, k, layer.gathered_v, layer.output, tuple(sorted(replaced)), scale, problem)


def pattern1_layers(
    index: GraphIndex, queries: Iterable[str], detected: Iterable[AttentionLayer]
) -> dict[str, tuple[AttentionLayer, PatternMatch]]:
    """Of ``queries``, those that name a layer as Polygraphy's pattern 1 does (its Q before the
    scale): Q -> the layer and the match."""
    wanted = set(queries)
    if not wanted:
        return {}
    by_score = {layer.nodes[0]: layer for layer in detected}
    found: dict[str, tuple[AttentionLayer, PatternMatch]] = {}
    for match in match_all(index, 1):
        layer = by_score.get(match.matmul1.label)
        if match.q in wanted and layer is not None:
            found.setdefault(match.q, (layer, match))
    return found


def _score_scale(
    index: GraphIndex, layer: AttentionLayer, nodes: list[Node]
) -> tuple[float | None, str]:
    """The constant factor the nodes between the two MatMuls apply to the scores, and what
    among them a mask-less fused attention cannot do."""
    masks = set(layer.masks)
    scale = 1.0
    passed_softmax = False
    for node in nodes:
        if node.op_type in MATMULS or node.op_type == "Softmax":
            passed_softmax |= node.op_type == "Softmax"
            continue
        allowed = NEUTRAL_PROBS_OPS if passed_softmax else NEUTRAL_SCORE_OPS
        if node.op_type in allowed:
            continue
        if not passed_softmax and node.op_type in MASK_OPS and masks.intersection(node.inputs):
            continue
        if not passed_softmax and node.op_type in ("Mul", "Div"):
            factor = _scalar(index, node.inputs[1])
            if node.op_type == "Mul" and factor is None:
                factor = _scalar(index, node.inputs[0])
            if factor is not None and factor != 0:
                scale = scale * factor if node.op_type == "Mul" else scale / factor
                continue
            return None, f"its scores are scaled by {node.label} by no constant"
        if node.op_type == "Where" and passed_softmax:
            continue  # HF's guard of fully masked rows: no row is, without a padding mask
        return None, f"its {node.label} ({node.op_type}) is no part of a fused attention"
    return scale, ""


def _pattern1_scale(index: GraphIndex, match: PatternMatch) -> float | None:
    """Pattern 1 scales Q and K each by ``Sqrt(w / Sqrt(head_dim))``: the scores by
    ``w / sqrt(head_dim)``, with ``head_dim`` Q's last dim."""
    mul = index.producer_of(match.matmul1.inputs[0])
    sqrt = index.producer_of(mul.inputs[1]) if mul is not None else None
    cast = index.producer_of(sqrt.inputs[0]) if sqrt is not None else None
    div = index.producer_of(cast.inputs[0]) if cast is not None else None
    if div is None or div.op_type != "Div":
        return None
    weight = _scalar(index, div.inputs[0])
    shape = index.declared_shape(match.q) or ShapeInference(index).shape(match.q)
    head_dim = shape[-1] if shape else None
    if weight is None or not isinstance(head_dim, int) or head_dim <= 0:
        return None
    return weight / math.sqrt(head_dim)


def _scalar(index: GraphIndex, tensor: str) -> float | None:
    value = index.constant_value(tensor)
    if value is None or value.size != 1:
        return None
    return float(value.reshape(()))


def fused_layout(index: GraphIndex, shapes: ShapeInference, layer: AttentionLayer) -> FusedLayout:
    """The shuffles that bring the layer's Q, K and V to ``[batch, heads, seq, head_dim]``, and
    its causality; a problem when the layer has another mask or layout."""
    site = fused_site(index, layer)
    is_causal = layer.causal is not None
    if layer.kv_context:
        # Its K and V are whole on every rank: the fused op would gather nb_rank copies.
        return FusedLayout(
            None,
            None,
            None,
            is_causal,
            f"its K and V carry the context dim {layer.kv_context}, which every rank holds "
            "whole: it stays native and nothing is gathered",
        )
    if site.problem:
        return FusedLayout(None, None, None, is_causal, site.problem)
    shuffles = expected_shuffles(shapes, site)
    if shuffles is None:
        ranks = [shapes.rank(name) for name in (site.q, site.k, site.v, site.output)]
        return FusedLayout(
            None,
            None,
            None,
            is_causal,
            f"its Q, K, V and output have ranks {', '.join(map(str, ranks))}, not "
            f"{FUSED_RANK} each ([batch, heads, seq, head_dim])",
        )
    if drops_mask(index, layer):
        what = "a causal mask combined with another" if is_causal else "a mask that is not causal"
        return FusedLayout(
            *shuffles,
            is_causal,
            f"it has {what} (a padding mask, a bias, a window), which the mask-less fused "
            "attention would drop",
        )
    return FusedLayout(*shuffles, is_causal)


def expected_shuffles(
    shapes: ShapeInference, site: FusedSite
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, ...] | None] | None:
    """The Q, K and V shuffles of a MatMul layer of rank-4 tensors (None: of another rank).
    MatMul(q, k): q is [b, h, s, d] and k [b, h, d, s]; MatMul(p, v): v is [b, h, s, d]."""
    ranks = [shapes.rank(name) for name in (site.q, site.k, site.v, site.output)]
    if any(rank != FUSED_RANK for rank in ranks):
        return None
    return None, (0, 1, 3, 2), None


def drops_mask(index: GraphIndex, layer: AttentionLayer) -> bool:
    """Whether a mask-less fused attention (causal or not) would drop a mask of the layer."""
    if not layer.masks:
        return False
    return layer.causal is None or _reads_data_inputs(index, layer.masks)


def _reads_data_inputs(index: GraphIndex, masks: Iterable[str]) -> bool:
    """Whether the masks read the values of a graph input (not only its shape): a padding
    mask, which no causal flag stands for."""
    graph_inputs = set(index.input_infos) - set(index.initializers)
    queue, seen = list(masks), set()
    while queue and len(seen) < MAX_MASK_WALK:
        tensor = queue.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        if tensor in graph_inputs:
            return True
        producer = index.producer_of(tensor)
        if producer is None or producer.op_type in SHAPE_OPS:
            continue
        queue.extend(name for name in producer.inputs if name)
    return False


def shuffled(shuffle: tuple[int, ...] | None, rank: int = FUSED_RANK) -> tuple[int, ...]:
    """The permutation a shuffle applies (none given: the identity)."""
    return tuple(shuffle) if shuffle else tuple(range(rank))
