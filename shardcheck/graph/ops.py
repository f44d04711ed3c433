"""What shardcheck knows of ONNX ops by class, each fact stated once for every stage that reads it.

Shape inference, axis inference, attention detection, element types, verify's run checks and
the simulation all ask these questions ("is this a reduction?", "where does this fused op read
K?"); a table kept beside each of them would drift from the others.
"""

from __future__ import annotations

from typing import NamedTuple

MICROSOFT_DOMAIN = "com.microsoft"


def is_default_domain(domain: str) -> bool:
    """Whether ``domain`` names the ONNX operator set (empty, as exporters write it, or spelt
    out)."""
    return domain in ("", "ai.onnx")


# Ops whose output depends on their input's shape, not on its values.
SHAPE_OPS = frozenset(["Shape", "Size"])
# Ops that lay their data out to a target shape (their second input): the ones whose target
# the extension's shard scales to a rank's length (sharding/lengths.py).
RESIZING_OPS = frozenset(["Reshape", "Expand"])

# Comparisons and logic: elementwise, with a boolean output.
BOOLEAN_OPS = frozenset(
    "And Equal Greater GreaterOrEqual IsInf IsNaN Less LessOrEqual Not Or Xor".split()
)
# Ops whose output has the broadcast shape of their inputs: elementwise ops, and those that keep
# their one input's shape (Softmax, Dropout, Trilu).
ELEMENTWISE = BOOLEAN_OPS | frozenset(
    "Add Sub Mul Div Pow Mod Max Min Where Cast CastLike Sqrt Erf Tanh Relu Gelu FastGelu "
    "Sigmoid Neg Exp Log Abs Reciprocal Clip Floor Ceil Round Sin Cos Identity Dropout Softmax "
    "LogSoftmax HardSigmoid LeakyRelu Elu Selu Softplus QuickGelu BiasGelu Sign Trilu".split()
)

# Normalisations over the axes from their ``axis`` attribute (-1 by default) to the last.
LAYER_NORMALISATIONS = frozenset(
    "LayerNormalization SimplifiedLayerNormalization SkipLayerNormalization "
    "SkipSimplifiedLayerNormalization RMSNormalization".split()
)
# Those of the sum of their first two inputs (com.microsoft's, fused by onnxruntime's
# transformer optimizer: the residual and the block's output, whose sum is also an output).
SKIP_NORMALISATIONS = frozenset(["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"])
# Every normalisation: its first output has its first input's shape.
NORMALISATIONS = LAYER_NORMALISATIONS | frozenset(
    ["BatchNormalization", "InstanceNormalization", "LpNormalization"]
)

# ONNX's reductions: over the axes given by their ``axes`` (an attribute, or an input in newer
# opsets; all axes without), keeping them as 1 unless ``keepdims`` is 0.
REDUCTIONS = frozenset(
    "ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd "
    "ReduceSum ReduceSumSquare".split()
)

# Products of their first two inputs' last two axes, broadcasting the axes before.
MATMULS = frozenset(["MatMul", "FusedMatMul"])


class FusedAttentionInputs(NamedTuple):
    """Where a fused attention op reads Q, K and V, and the input that masks its scores over
    queries and keys, [..., query, key] (ONNX Attention's attn_mask; com.microsoft's
    attention_bias), if it has one. Its masks over the keys only (key_padding_mask,
    mask_index) are no such input: each rank reads them whole."""

    q: int
    k: int
    v: int
    scores_mask: int | None

    @property
    def packed(self) -> bool:
        """Whether the node computes Q, K and V itself, from one input and packed weights."""
        return self.q == self.k == self.v


# By (domain, op type), the default domain written "".
_FUSED_ATTENTION = {
    ("", "Attention"): FusedAttentionInputs(0, 1, 2, 3),
    (MICROSOFT_DOMAIN, "MultiHeadAttention"): FusedAttentionInputs(0, 1, 2, 5),
    (MICROSOFT_DOMAIN, "GroupQueryAttention"): FusedAttentionInputs(0, 1, 2, None),
    (MICROSOFT_DOMAIN, "Attention"): FusedAttentionInputs(0, 0, 0, 5),
}
# The op types among them, of whichever domain.
FUSED_ATTENTION_OP_TYPES = frozenset(op_type for _, op_type in _FUSED_ATTENTION)


def fused_attention_inputs(domain: str, op_type: str) -> FusedAttentionInputs | None:
    """The inputs of a fused attention op, or None for any other op."""
    return _FUSED_ATTENTION.get(("" if is_default_domain(domain) else domain, op_type))
