"""Attention layers as real exporters write them.

A decomposed layer is found from its Softmax: back through what exporters put between the score
MatMul and the Softmax (a scale by Div or Mul, an additive mask, a Where mask, Casts, Reshapes),
and forward through what they put between the Softmax and the context MatMul (Cast, Dropout,
Identity, the IsNaN/Where guard of HF's SDPA path). The score MatMul's second input is what CP
gathers for K, the context MatMul's second input what it gathers for V. Fused nodes (ONNX
``Attention``, com.microsoft ``Attention``, ``MultiHeadAttention``, ``GroupQueryAttention``) are
layers too. Each Softmax is looked at within a bounded neighbourhood: linear in the graph.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from shardcheck.analysis.causal import causal_mask
from shardcheck.analysis.einsum import context_roles, node_equation, score_roles
from shardcheck.analysis.polygraphy import match_all
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import Dim, GraphIndex, Node
from shardcheck.graph.ops import (
    MATMULS,
    FusedAttentionInputs,
    fused_attention_inputs,
)

SCORE_SIDE_OPS = frozenset(
    "Div Mul Add Sub Where Cast Reshape Identity Clip Tanh Max Min Squeeze Unsqueeze".split()
)
PROBS_SIDE_OPS = frozenset("Cast Dropout Identity Where Reshape Mul Squeeze Unsqueeze".split())
# Attention sinks (GPT-OSS): a per-head logit Concat-ed to the scores on the Softmax's axis,
# the running max subtracted (Sub of a ReduceMax), and the sink's column Sliced off after.
SINK_CONCAT = "Concat"
SINK_SLICE = "Slice"
# Between an Einsum's scores and the Softmax, these would move the axis the Softmax reads.
RESHAPING_OPS = frozenset(("Reshape", "Squeeze", "Unsqueeze", "Transpose", "Flatten"))
# K or V on its way from the projection to the MatMul: layout changes, the SDPA scale, GQA.
KV_LAYOUT_OPS = frozenset("Transpose Reshape Mul Div Cast Identity Expand Unsqueeze Tile".split())
MAX_SIDE_DEPTH = 8


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: what a hint names, what CP gathers, where the sequence is."""

    name: str
    kind: str  # "decomposed" or "fused"
    q: str  # the tensor a hint's ``q`` names: the score MatMul's first input (fused: input 0)
    gathered_k: str  # what CP all-gathers for K
    gathered_v: str  # what CP all-gathers for V
    k: str  # K before its layout changes (Transpose, Reshape, GQA expansion, scale)
    v: str
    output: str
    nodes: tuple[str, ...]  # score MatMul, Softmax, context MatMul (or the fused node)
    q_axis: int | None  # query axis of ``q``
    k_axis: int | None  # key axis of ``gathered_k``
    v_axis: int | None  # key axis of ``gathered_v``
    k_rank: int | None
    v_rank: int | None
    causal: str | None  # how a causal mask is built, or None
    masks: tuple[str, ...] = ()  # tensors combined with the scores (additive or Where masks)
    sinks: tuple[str, ...] = ()  # sink logits Concat-ed to the scores (GPT-OSS)
    # The dim K and V carry on their key axis when it is no sequence's: a context of its own
    # length (a cross-attention to text), or latents of a fixed length attending to each other
    # in a model whose sequence is symbolic. Every rank holds them whole.
    kv_context: Dim = None
    # The fixed number of queries of a learned latent array (Perceiver), in a model whose
    # sequence is symbolic: every rank holds Q whole, and computes the output whole.
    latents: int | None = None
    polygraphy_patterns: tuple[int, ...] = field(default=())
    op_type: str = ""
    # Indices of the nodes from the score MatMul to the context MatMul (or the fused node).
    internal: tuple[int, ...] = field(default=(), repr=False)
    # The query axis of ``output``; None: its rank less 2 (MatMul's, and the fused nodes').
    output_axis: int | None = None

    @property
    def polygraphy_recognises(self) -> bool:
        return bool(self.polygraphy_patterns)

    @property
    def packed(self) -> bool:
        """Q, K and V computed from one input (a packed com.microsoft Attention): gathering
        its K and V gathers its Q too, so every rank computes the layer whole."""
        return self.q == self.gathered_k


class _Unranked:
    """Shapes that know no rank: what ``layer_tensors`` detects with."""

    def rank(self, tensor: str) -> int | None:
        return None


def detect_attention(
    index: GraphIndex, shapes: ShapeInference | None = None
) -> list[AttentionLayer]:
    """Every attention layer of the main graph, in graph order."""
    recognised: dict[int, list[int]] = {}
    for pattern in (0, 1):
        for match in match_all(index, pattern):
            recognised.setdefault(match.matmul1.index, []).append(pattern)
    shapes = shapes or ShapeInference(index)
    return with_contexts(shapes, _detect(index, shapes, recognised, look_for_causal=True))


def with_contexts(shapes: ShapeInference, layers: list[AttentionLayer]) -> list[AttentionLayer]:
    """``layers``, with what carries no sequence marked. K and V carry a context
    (``kv_context``) on a symbolic key dim that is no layer's symbolic query dim and holds none
    of their symbols (the sequence is what the queries run along; DiT's text context of length
    T only feeds K and V), or on a fixed key dim beside symbolic queries when K and V are
    computed from no input that holds a query dim. In a model whose sequence is symbolic, a
    fixed number of queries is a learned latent array (``latents``, Perceiver's), and K and V
    of a fixed length beside them are the latents too; in a model of fixed length (ViT's
    patches) a fixed size says nothing."""
    dims = [tuple(axis_dim(shapes, t, a) for t, a in _qkv_axes(layer)) for layer in layers]
    query_dims = {q for q, _, _ in dims if isinstance(q, str)}
    symbolic = bool(query_dims) or any(isinstance(k, str) for _, k, _ in dims)
    symbols = {word for dim in query_dims for word in re.findall(r"\w+", dim)}
    from_sequence: set[str] | None = None  # what the inputs holding a query dim reach
    latent_counts = {q for q, _, _ in dims if isinstance(q, int)} if symbolic else set()
    marked = []
    for layer, (query, key, value) in zip(layers, dims, strict=True):
        latents = query if isinstance(query, int) and symbolic else None
        context = key == value and (
            (isinstance(key, int) and latents is not None)
            or (
                isinstance(key, str)
                and bool(query_dims)
                and symbols.isdisjoint(re.findall(r"\w+", key))
            )
        )
        if key == value and isinstance(key, int) and isinstance(query, str):
            # A fixed key length beside symbolic queries: the latents (Perceiver IO's decoder
            # queries them from the input's positions), a length traced into a Reshape, or a
            # context of fixed length (a text encoder's 77 tokens), the last two told apart by
            # what K and V are computed from: none of the inputs that hold a query dim.
            if from_sequence is None:
                from_sequence = _from_inputs_holding(shapes.index, symbols)
            context = key in latent_counts or not {layer.gathered_k, layer.gathered_v} & (
                from_sequence
            )
        if context or latents is not None:
            layer = replace(layer, kv_context=key if context else None, latents=latents)
        marked.append(layer)
    return marked


def _from_inputs_holding(index: GraphIndex, symbols: set[str]) -> set[str]:
    """The tensors computed (through data, not shapes) from graph inputs whose declared shape
    holds one of ``symbols``."""
    holding = [
        name
        for name in index.graph_inputs
        if any(
            isinstance(dim, str) and not symbols.isdisjoint(re.findall(r"\w+", dim))
            for dim in index.declared_shape(name) or ()
        )
    ]
    return index.computed_from(holding, through_shapes=False)


def _qkv_axes(layer: AttentionLayer) -> tuple[tuple[str, int | None], ...]:
    return (
        (layer.q, layer.q_axis),
        (layer.gathered_k, layer.k_axis),
        (layer.gathered_v, layer.v_axis),
    )


def axis_dim(shapes: ShapeInference, tensor: str, axis: int | None) -> Dim:
    """The dim of ``tensor`` on ``axis`` (None when either is unknown)."""
    shape = shapes.shape(tensor)
    return shape[axis] if shape is not None and axis is not None and axis < len(shape) else None


def sequence_dim(shapes: ShapeInference, layers: list[AttentionLayer]) -> Dim:
    """The dim on the first layer's query axis (None when unknown); where every layer's
    queries are latents, the key dim of the first that attends to the sequence."""
    for layer in layers:
        if layer.latents is None:
            return axis_dim(shapes, layer.q, layer.q_axis)
    for layer in layers:
        if layer.kv_context is None:
            return axis_dim(shapes, layer.gathered_k, layer.k_axis)
    return axis_dim(shapes, layers[0].q, layers[0].q_axis)


def sequence_dims(shapes: ShapeInference, layers: list[AttentionLayer]) -> tuple[Dim, ...]:
    """Every sequence dim of the layers: ``sequence_dim`` first, then each other layer's own
    symbolic query dim (an encoder-decoder's decoder runs along ``decoder_sequence`` or
    ``target``; its cross-attention's keys are the encoder's). A fixed query dim of another
    size is no second sequence (DETR's object queries, Funnel's pooled queries)."""
    first = sequence_dim(shapes, layers)
    dims = [first]
    if not isinstance(first, str):
        return tuple(dims)
    for layer in layers:
        dim = axis_dim(shapes, layer.q, layer.q_axis)
        if layer.latents is None and isinstance(dim, str) and dim not in dims:
            dims.append(dim)
    return tuple(dims)


def layer_tensors(index: GraphIndex) -> list[AttentionLayer]:
    """The layers ``detect_attention`` finds, with the same tensors (Q, gathered K and V, masks,
    output), found without shape inference: their ranks are unknown here, their axes too
    (but an Einsum's, which its equation gives), and
    Polygraphy's patterns are not matched, and ``causal`` is not looked for. Which tensors a
    layer has never depends on shapes; verify needs them before onnxruntime loads the model,
    the rest later."""
    return _detect(index, _Unranked(), {}, look_for_causal=False)


def _detect(
    index: GraphIndex,
    shapes: ShapeInference | _Unranked,
    recognised: dict[int, list[int]],
    *,
    look_for_causal: bool,
) -> list[AttentionLayer]:
    layers: list[tuple[int, AttentionLayer]] = []
    for node in index.nodes:
        if node.op_type == "Softmax":
            layer = _decomposed(index, shapes, node, recognised, look_for_causal)
        elif (fused := fused_attention_inputs(node.domain, node.op_type)) is not None:
            layer = _fused(index, shapes, node, fused, look_for_causal)
        else:
            continue
        if layer is not None:
            layers.append(layer)
    return [layer for _, layer in sorted(layers, key=lambda item: item[0])]


def _decomposed(
    index: GraphIndex,
    shapes: ShapeInference | _Unranked,
    softmax: Node,
    recognised: dict[int, list[int]],
    look_for_causal: bool,
) -> tuple[int, AttentionLayer] | None:
    found = _score_matmul(index, softmax)
    if found is None:
        return None
    score, score_path = found
    sinks = _sinks(score, score_path)
    found_context = _context_matmul(index, softmax, sinks=bool(sinks))
    if found_context is None:
        return None
    context, probs_path, probs = found_context
    sides = _score_side(score, softmax, score_path), _context_side(context, probs)
    if sides[0] is None or sides[1] is None:
        return None
    (q, gathered_k, q_axis, k_axis), (gathered_v, v_axis, output_axis) = sides
    if gathered_k in index.initializers or gathered_v in index.initializers:
        return None  # a projection by weights (a classifier head, a router), not attention
    q_rank, k_rank, v_rank = (shapes.rank(t) for t in (q, gathered_k, gathered_v))
    # A sink column is combined with the scores as a mask is: each rank needs its query rows.
    masks = tuple(dict.fromkeys((*_mask_operands(index, score, score_path), *sinks)))
    layer = AttentionLayer(
        name=score.label,
        kind="decomposed",
        q=q,
        gathered_k=gathered_k,
        gathered_v=gathered_v,
        k=_kv_source(index, gathered_k),
        v=_kv_source(index, gathered_v),
        output=context.outputs[0],
        nodes=(score.label, softmax.label, context.label),
        q_axis=_axis(q_axis, q_rank, -2),
        k_axis=_axis(k_axis, k_rank, -1),
        v_axis=_axis(v_axis, v_rank, -2),
        k_rank=k_rank,
        v_rank=v_rank,
        causal=causal_mask(index, masks) if look_for_causal else None,
        masks=masks,
        sinks=sinks,
        polygraphy_patterns=tuple(recognised.get(score.index, ())),
        op_type=f"{score.op_type}/Softmax/{context.op_type}",
        output_axis=output_axis,
        internal=tuple(
            sorted(
                {score.index, softmax.index, context.index}
                | {n.index for n in (*score_path, *probs_path)}
            )
        ),
    )
    return score.index, layer


def _axis(known: int | None, rank: int | None, from_end: int) -> int | None:
    """An Einsum's axis (``known``, from its equation), or a MatMul's: ``from_end`` of the
    operand's rank, when known."""
    if known is not None:
        return known
    return None if rank is None or rank < 2 else rank + from_end


def _score_side(
    score: Node, softmax: Node, score_path: list[Node]
) -> tuple[str, str, int | None, int | None] | None:
    """Q, K and (for an Einsum) their query and key axes; a MatMul's follow from its rank."""
    if score.op_type != "Einsum":
        return score.inputs[0], score.inputs[1], None, None
    if any(node.op_type in RESHAPING_OPS for node in score_path):
        return None  # the Softmax's axis would not be the equation's
    equation = node_equation(score, [None, None])
    roles = None if equation is None else score_roles(equation, softmax.attr("axis", -1))
    if roles is None:
        return None
    return score.inputs[roles.q], score.inputs[roles.k], roles.q_axis, roles.k_axis


def _context_side(context: Node, probs: str) -> tuple[str, int | None, int | None] | None:
    """V and (for an Einsum) its key axis and the output's query axis."""
    if context.op_type != "Einsum":
        return context.inputs[1], None, None
    equation = node_equation(context, [None, None])
    roles = None if equation is None else context_roles(equation, context.inputs.index(probs))
    if roles is None:
        return None
    return context.inputs[roles.v], roles.v_axis, roles.output_axis


def _score_matmul(index: GraphIndex, softmax: Node) -> tuple[Node, list[Node]] | None:
    """The MatMul that computes the scores, and the nodes from it to the Softmax."""
    queue: deque[tuple[str, int, list[Node]]] = deque([(softmax.inputs[0], 0, [])])
    seen: set[str] = set()
    while queue:
        tensor, depth, path = queue.popleft()
        if tensor in seen or depth > MAX_SIDE_DEPTH:
            continue
        seen.add(tensor)
        producer = index.producer_of(tensor)
        if producer is None:
            continue
        if producer.op_type in MATMULS and len(producer.inputs) >= 2:
            return producer, path
        if producer.op_type == "Einsum" and len(producer.inputs) == 2:
            return producer, path
        if producer.op_type == SINK_CONCAT and _on_softmax_axis(producer, softmax):
            for name in producer.inputs:
                if name:
                    queue.append((name, depth + 1, [*path, producer]))
            continue
        if producer.op_type not in SCORE_SIDE_OPS:
            continue
        data_inputs = producer.inputs[1:3] if producer.op_type == "Where" else producer.inputs[:2]
        if producer.op_type in ("Reshape", "Squeeze", "Unsqueeze", "Cast", "Identity", "Tanh"):
            data_inputs = producer.inputs[:1]
        for name in data_inputs:
            if name:
                queue.append((name, depth + 1, [*path, producer]))
    return None


def _on_softmax_axis(concat: Node, softmax: Node) -> bool:
    return concat.attr("axis", 0) == softmax.attr("axis", -1)


def _sinks(score: Node, score_path: list[Node]) -> tuple[str, ...]:
    """The sink logits Concat-ed to the scores on their way to the Softmax."""
    on_path = {o for node in (score, *score_path) for o in node.outputs}
    return tuple(
        name
        for node in score_path
        if node.op_type == SINK_CONCAT
        for name in node.inputs
        if name and name not in on_path
    )


def _context_matmul(
    index: GraphIndex, softmax: Node, *, sinks: bool = False
) -> tuple[Node, list[Node], str] | None:
    """The MatMul (or Einsum) that applies the probabilities to V, the nodes passed on the
    way, and the probabilities it reads. With ``sinks``, a Slice that drops their columns is
    passed too."""
    queue: deque[tuple[str, int]] = deque([(softmax.outputs[0], 0)])
    seen: set[str] = set()
    passed: list[Node] = []
    while queue:
        tensor, depth = queue.popleft()
        if tensor in seen or depth > MAX_SIDE_DEPTH:
            continue
        seen.add(tensor)
        for consumer in index.consumers_of(tensor):
            if consumer.op_type in MATMULS and consumer.inputs[0] == tensor:
                return consumer, passed, tensor
            if consumer.op_type == "Einsum" and len(consumer.inputs) == 2:
                return consumer, passed, tensor
            passes = consumer.op_type in PROBS_SIDE_OPS or (
                sinks and consumer.op_type == SINK_SLICE and consumer.inputs[0] == tensor
            )
            if passes and consumer.outputs:
                passed.append(consumer)
                queue.append((consumer.outputs[0], depth + 1))
    return None


def _mask_operands(index: GraphIndex, score: Node, score_path: list[Node]) -> tuple[str, ...]:
    """Tensors combined with the scores on their way to the Softmax (masks and biases)."""
    on_path = {o for node in (score, *score_path) for o in node.outputs}
    masks: list[str] = []
    for node in score_path:
        if node.op_type in ("Add", "Sub"):
            masks.extend(
                name
                for name in node.inputs[:2]
                if name and name not in on_path and not _max_of_path(index, name, on_path)
            )
        elif node.op_type == "Where":
            masks.append(node.inputs[0])
    # Scalars on the path are scales and fill values, not masks.
    kept = (m for m in masks if not _is_scalar_or_vector_constant(index, m))
    return tuple(dict.fromkeys(kept))


def _max_of_path(index: GraphIndex, tensor: str, on_path: set[str]) -> bool:
    """Whether ``tensor`` is the running max of the scores themselves (subtracted before a
    Softmax for stability), not a mask."""
    producer = index.producer_of(tensor)
    return (
        producer is not None
        and producer.op_type == "ReduceMax"
        and bool(producer.inputs)
        and producer.inputs[0] in on_path
    )


def _is_scalar_or_vector_constant(index: GraphIndex, tensor: str) -> bool:
    ndim = index.constant_ndim(tensor)
    return ndim is not None and ndim < 2


def _kv_source(index: GraphIndex, tensor: str) -> str:
    current = tensor
    for _ in range(MAX_SIDE_DEPTH):
        producer = index.producer_of(current)
        if producer is None or producer.op_type not in KV_LAYOUT_OPS:
            return current
        current = producer.inputs[0]
    return current


def _fused(
    index: GraphIndex,
    shapes: ShapeInference | _Unranked,
    node: Node,
    inputs: FusedAttentionInputs,
    look_for_causal: bool,
) -> tuple[int, AttentionLayer]:
    q_pos, k_pos, v_pos, at = inputs
    q, k, v = node.inputs[q_pos], node.inputs[k_pos], node.inputs[v_pos]
    q_rank, k_rank, v_rank = (shapes.rank(t) for t in (q, k, v))
    mask = node.inputs[at] if at is not None and at < len(node.inputs) else ""
    masks = (mask,) if mask and shapes.rank(mask) not in (0, 1) else ()
    causal = None
    if node.attr("is_causal", 0) or node.attr("unidirectional", 0):
        causal = f"is_causal attribute of {node.label}"
    elif node.op_type == "GroupQueryAttention":
        causal = f"{node.label} (GroupQueryAttention is always causal)"
    elif masks and look_for_causal:
        causal = causal_mask(index, masks)
    layer = AttentionLayer(
        name=node.label,
        kind="fused",
        q=q,
        gathered_k=k,
        gathered_v=v,
        k=k,
        v=v,
        output=node.outputs[0],
        nodes=(node.label,),
        q_axis=None if q_rank is None or q_rank < 2 else q_rank - 2,
        k_axis=None if k_rank is None or k_rank < 2 else k_rank - 2,
        v_axis=None if v_rank is None or v_rank < 2 else v_rank - 2,
        k_rank=k_rank,
        v_rank=v_rank,
        causal=causal,
        op_type=f"{node.domain + '.' if node.domain else ''}{node.op_type}",
        internal=(node.index,),
        masks=masks,
    )
    return node.index, layer


def gathered_by_q(layers: Iterable[AttentionLayer]) -> dict[str, list[tuple[str, str]]]:
    """Q -> (gathered K, gathered V) of each of ``layers`` with that Q."""
    gathered: dict[str, list[tuple[str, str]]] = {}
    for layer in layers:
        gathered.setdefault(layer.q, []).append((layer.gathered_k, layer.gathered_v))
    return gathered
