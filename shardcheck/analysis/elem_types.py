"""Element types of a graph's tensors, inferred forward from its inputs, initializers and
constants by each op's rule (ONNX's type constraints: most ops give their first input's type).

The simulation types its stage inputs with these before any run, so that the stages' sessions
can be made ahead, side by side. A tensor made by an op without a rule here is left out, never
guessed; a stage is only made ahead when all its inputs are typed, and its session is used only
if the values it gets have the types it was made for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shardcheck.graph import protos
from shardcheck.graph.ops import BOOLEAN_OPS, REDUCTIONS, is_default_domain

BOOL = protos.TensorProto.BOOL
INT64 = protos.TensorProto.INT64
FLOAT = protos.TensorProto.FLOAT

# Every output has the type of the first input.
_AS_FIRST_INPUT = REDUCTIONS | frozenset(
    """Abs Acos Acosh Add Asin Asinh Atan Atanh Attention AveragePool BatchNormalization BitShift
    BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Ceil Celu Clip Col2Im Compress Concat Conv
    ConvTranspose Cos Cosh CumSum DepthToSpace Det Div Dropout Einsum Elu Erf Exp Expand Flatten
    Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool HardSigmoid
    HardSwish Hardmax Identity InstanceNormalization LRN LayerNormalization LeakyRelu Log
    LogSoftmax LpNormalization MatMul Max MaxPool Mean Min Mish Mod Mul Neg PRelu Pad Pow Range
    Reciprocal Relu Reshape Resize ReverseSequence RMSNormalization RotaryEmbedding Round
    ScatterElements ScatterND Selu Shrink Sigmoid Sign Sin Sinh Slice Softmax Softplus Softsign
    SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile Transpose Trilu
    Unsqueeze Upsample""".split()
)
# Only the first output has the first input's type; the others are statistics or masks.
_FIRST_OUTPUT_ONLY = frozenset(
    "Attention BatchNormalization Dropout LayerNormalization MaxPool".split()
)
_INT64 = frozenset("ArgMax ArgMin NonZero Shape Size".split())
_CONSTANT_VALUES = {
    "value_float": FLOAT,
    "value_floats": FLOAT,
    "value_int": INT64,
    "value_ints": INT64,
    "value_string": protos.TensorProto.STRING,
    "value_strings": protos.TensorProto.STRING,
}


def infer_elem_types(
    nodes: Iterable[protos.NodeProto], known: Mapping[str, int], *, same_as_input: str = ""
) -> dict[str, int]:
    """``known`` (graph inputs, initializers) with the types of the outputs of ``nodes``, given
    in a topological order. ``same_as_input``: an op type (of any domain) whose output has its
    input's type (the simulation's collectives)."""
    types = dict(known)
    for node in nodes:
        op = node.op_type
        if op == same_as_input or (is_default_domain(node.domain) and op in _AS_FIRST_INPUT):
            first = types.get(node.input[0]) if node.input else None
            if first is None:
                continue
            outputs = node.output[:1] if op in _FIRST_OUTPUT_ONLY else node.output
            types.update((name, first) for name in outputs if name)
            continue
        if not is_default_domain(node.domain) or not node.output:
            continue
        if op == "TopK" and node.input:
            # Values of the input's type, then their int64 indices (a MoE router's).
            if (first := types.get(node.input[0])) is not None and node.output[0]:
                types[node.output[0]] = first
            if len(node.output) > 1 and node.output[1]:
                types[node.output[1]] = INT64
            continue
        found = _output_type(node, types)
        if found is not None and node.output[0]:
            types[node.output[0]] = found
    return types


def _output_type(node: protos.NodeProto, types: Mapping[str, int]) -> int | None:
    op = node.op_type
    if op in BOOLEAN_OPS:
        return BOOL
    if op in _INT64:
        return INT64
    if op == "Cast":
        return next((a.i for a in node.attribute if a.name == "to"), None)
    if op == "CastLike" and len(node.input) > 1:
        return types.get(node.input[1])
    if op == "Where" and len(node.input) > 1:
        return types.get(node.input[1])
    if op == "Constant":
        for attribute in node.attribute:
            if attribute.name in ("value", "sparse_value"):
                tensor = (
                    attribute.t if attribute.name == "value" else attribute.sparse_tensor.values
                )
                return tensor.data_type or None
            if attribute.name in _CONSTANT_VALUES:
                return _CONSTANT_VALUES[attribute.name]
        return None
    if op == "ConstantOfShape":
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return value.data_type if value is not None and value.data_type else FLOAT
    return None
