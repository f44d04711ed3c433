"""Where the sequence axis goes through one node: the position-wise ops and their axis maps.

An op is position-wise along an axis when each position of its output depends only on the same
position of its inputs along that axis (elementwise ops, projections, layout changes that keep
the axis whole, embedding lookups, normalisations over other axes). CP can run such an op on a
slice of the sequence. ``input_axes`` answers, for an output axis, which input axes carry it;
None means the op mixes or creates positions along that axis (a reduction over it, a Concat or
Slice along it, a Range, a Conv wider than one position, ...), so CP cannot cut through it
there.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardcheck.analysis.einsum import node_equation
from shardcheck.analysis.index_grid import identity_along
from shardcheck.analysis.selections import (
    is_counted_split,
    is_full_sort,
    is_selected_count,
    selected_by,
)
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import Size, size_of
from shardcheck.graph.index import Dim, GraphIndex, Node, Shape
from shardcheck.graph.ops import (
    ELEMENTWISE,
    LAYER_NORMALISATIONS,
    MATMULS,
    REDUCTIONS,
    SKIP_NORMALISATIONS,
    fused_attention_inputs,
)

AxisList = list[tuple[str, int]]
_UNKNOWN = object()  # not in a memo yet

# The ops whose input axes ``_aligned`` gives (or none at all, as Trilu).
ALIGNED_OPS = ELEMENTWISE | LAYER_NORMALISATIONS | frozenset(["Concat", "Expand"])


def carries(dim: Dim, seq: Dim) -> bool:
    """Whether a dim is the sequence length, or a merged dim with it as a factor."""
    if seq is None or dim is None:
        return False
    if isinstance(seq, int):
        return dim == seq
    return isinstance(dim, str) and seq in dim.split("*")


def carries_any(dim: Dim, sequences: Iterable[Dim]) -> bool:
    """Whether a dim carries one of the sequence dims (an encoder-decoder has two)."""
    return any(carries(dim, seq) for seq in sequences)


class AxisMapper:
    """``seq``: the model's sequence dim; ``others``: the other sequence dims its layers run
    along (an encoder-decoder's decoder length), which the position-wise ops carry too."""

    def __init__(
        self, index: GraphIndex, shapes: ShapeInference, seq: Dim, others: Iterable[Dim] = ()
    ) -> None:
        self.index = index
        self.shapes = shapes
        self.seq = seq
        self.sequences: tuple[Dim, ...] = (seq, *(dim for dim in others if dim != seq))
        # The frontier search asks the same questions in every round: answer each once.
        self._memo: dict[tuple[int, int], AxisList | None] = {}
        self._forward_memo: dict[tuple[int, str, int], int | None] = {}
        # A reshape's blocks depend on its two shapes only: a model's layers share them.
        self._reshape_blocks: dict[tuple[Shape, Shape], list[tuple[list[int], list[int]]]] = {}

    def input_axes(self, node: Node, out_axis: int) -> AxisList | None:
        key = (node.index, out_axis)
        found = self._memo.get(key, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._memo[key] = self._input_axes(node, out_axis)
        return found  # type: ignore[return-value]

    def _input_axes(self, node: Node, out_axis: int) -> AxisList | None:
        op = node.op_type
        out_rank = self.shapes.rank(node.outputs[0])
        if out_rank is None or not 0 <= out_axis < out_rank:
            return None
        if op in ("Softmax", "LogSoftmax"):
            if node.attr("axis", -1) % out_rank == out_axis:
                return None
            return self._aligned(node.inputs[:1], out_axis, out_rank)
        if op in ("Dropout", "Identity", "Cast", "CastLike"):
            return self._aligned(node.inputs[:1], out_axis, out_rank)
        if op in ELEMENTWISE:
            if op == "Trilu":
                return None
            return self._aligned(node.inputs, out_axis, out_rank)
        if op in LAYER_NORMALISATIONS:
            first = node.attr("axis", -1) % out_rank
            normalised = node.inputs[: 2 if op in SKIP_NORMALISATIONS else 1]
            return None if out_axis >= first else self._aligned(normalised, out_axis, out_rank)
        if op == "Transpose":
            perm = node.attr("perm") or list(reversed(range(out_rank)))
            return [(node.inputs[0], perm[out_axis])]
        if op in MATMULS:
            return self._matmul(node, out_axis, out_rank)
        if op == "Einsum":
            return self._einsum(node, out_axis)
        if op == "Conv":
            return self._conv(node, out_axis)
        if op == "Gemm":
            if out_axis != 0 or node.attr("transA", 0):
                return None
            return [(node.inputs[0], 0)]
        if op == "Gather":
            return self._gather(node, out_axis)
        if op == "GatherND":
            return self._gather_nd(node, out_axis)
        if op == "RotaryEmbedding":
            return self._rotary(node, out_axis, out_rank)
        if op == "ScatterND":
            return self._scatter_nd(node, out_axis)
        if op in ("GatherElements", "ScatterElements"):
            # Along any axis but the one it indexes, each element is read or written at its
            # own position (a mixture of experts' weights of each token's chosen experts, its
            # mask of each token's chosen groups), where the indices span the data's axis.
            if node.attr("axis", 0) % out_rank == out_axis:
                if op == "ScatterElements":
                    # Rows written back at the sequence positions a NonZero selects
                    # (TorchScript's index_add_ of an expert's output at its tokens).
                    if self._selected_axis(node, out_axis + 1) == out_axis:
                        return [(name, out_axis) for name in node.inputs]
                    return None
                # Along the axis it indexes, each element is the data's at its own index's
                # value: the indices' axis, the data read whole (DeBERTa's relative scores,
                # each query's scores picked out of every position's).
                return [(node.inputs[1], out_axis)]
            dims = {_dim(self.shapes, name, out_axis) for name in node.inputs}
            if len(dims) != 1 or None in dims:
                return None
            return [(name, out_axis) for name in node.inputs]
        if op == "NonZero":
            # Its coordinates [rank, count]: the count runs along the selected positions of
            # the input's one sequence axis (selections.py); the other axis is new.
            if out_axis != 1:
                return None
            axis = self._sequence_axis(node.inputs[0])
            return None if axis is None else [(node.inputs[0], axis)]
        if op == "TopK":
            # Values and indices alike: each row of the axis it selects along is its own
            # (a mixture of experts picks each token's experts among its own scores).
            if node.attr("axis", -1) % out_rank == out_axis:
                # A sort of the whole sequence-carrying axis orders a rank's positions among
                # themselves: a selection of them (selections.py), as a NonZero's are.
                if is_full_sort(self.shapes, node) and (
                    self._sequence_axis(node.inputs[0]) == out_axis
                ):
                    return [(node.inputs[0], out_axis)]
                return None
            return [(node.inputs[0], out_axis)]
        if op in ("Reshape", "Flatten"):
            return self._reshape(node, out_axis)
        if op == "OneHot":
            # Each index its own row of the depth (a mixture of experts' mask of each
            # token's experts): the depth's axis is new, the others are the indices'.
            depth_axis = node.attr("axis", -1) % out_rank
            if out_axis == depth_axis:
                return None
            return [(node.inputs[0], out_axis - (out_axis > depth_axis))]
        if op in ("Unsqueeze", "Squeeze"):
            return self._unsqueeze(node, out_axis, out_rank)
        if op in ("Split", "Slice"):
            # A Split by each expert's count of a selection cuts no rank's tokens apart.
            cut = out_axis in self._cut_axes(node, out_rank)
            if cut and not is_counted_split(self.shapes, node):
                return None
            return [(node.inputs[0], out_axis)]
        if op == "Concat":
            if node.attr("axis", 0) % out_rank == out_axis:
                # Along its axis, a Concat of one tensor (and of empty ones) copies it: an
                # empty cache's K and V concatenated with a layer's (TorchScript's XLM).
                held = [name for name in node.inputs if _dim(self.shapes, name, out_axis) != 0]
                if len(held) > 1 and all(
                    is_selected_count(_dim(self.shapes, name, out_axis)) for name in held
                ):
                    # The experts' parts of a selection, put back in its order.
                    return [(name, out_axis) for name in held]
                return [(held[0], out_axis)] if len(held) == 1 else None
            return self._aligned(node.inputs, out_axis, out_rank)
        if op == "Expand":
            return self._aligned(node.inputs[:1], out_axis, out_rank)
        if op == "ConstantOfShape":
            # Filled to the whole shape of a tensor (zeros the size of the experts' input):
            # as long as that tensor along each of its axes.
            shape = self.index.producer_of(node.inputs[0])
            if shape is None or shape.op_type != "Shape" or shape.attr("start", 0) != 0:
                return None
            return None if shape.attr("end") is not None else [(shape.inputs[0], out_axis)]
        if op == "Tile":
            # Repeats computed from shapes count too (a mixture of experts' [1, k, 1]).
            repeats = self.shapes.value(node.inputs[1]) if len(node.inputs) > 1 else None
            if repeats is None or len(repeats) != out_rank or repeats[out_axis] != 1:
                return None
            return [(node.inputs[0], out_axis)]
        if op in REDUCTIONS:
            return self._reduction(node, out_axis, out_rank)
        if op in ("ArgMax", "ArgMin"):
            # The index of each row's extreme along one axis, a reduction of it: every other
            # axis is the rows' own (a router's choice of each token's expert, as PhiMoE's
            # sparse mixer takes).
            return self._reduced(node, out_axis, [node.attr("axis", 0)])
        fused = fused_attention_inputs(node.domain, op)
        if fused is not None:
            query = node.inputs[fused.q]
            q_rank = self.shapes.rank(query)
            if q_rank is None or out_axis != out_rank - 2:
                return None
            return [(query, q_rank - 2)]
        return None

    def _conv(self, node: Node, out_axis: int) -> AxisList | None:
        """Along a spatial axis where the kernel is 1 wide, the stride 1 and no padding, each
        position is its own (SqueezeBERT's projections are Convs of kernel 1 over [batch,
        channels, sequence]); the weights are read whole. Along any other axis a Conv mixes
        positions, or creates them."""
        if out_axis < 2:
            return None
        spatial = out_axis - 2
        kernel = node.attr("kernel_shape")
        if not kernel:
            weight = self.shapes.shape(node.inputs[1]) if len(node.inputs) > 1 else None
            kernel = list(weight[2:]) if weight else None
        if not kernel or spatial >= len(kernel) or kernel[spatial] != 1:
            return None
        # auto_pad pads nothing for a kernel of 1 at stride 1; explicit pads may.
        strides = node.attr("strides") or [1] * len(kernel)
        pads = node.attr("pads") or [0] * (2 * len(kernel))
        if strides[spatial] != 1 or pads[spatial] or pads[spatial + len(kernel)]:
            return None
        return [(node.inputs[0], out_axis)]

    def output_axis(self, node: Node, tensor: str, axis: int) -> int | None:
        """The output axis that input ``tensor`` at ``axis`` maps to (first output), if any."""
        key = (node.index, tensor, axis)
        found = self._forward_memo.get(key, _UNKNOWN)
        if found is not _UNKNOWN:
            return found  # type: ignore[return-value]
        found = None
        out_rank = self.shapes.rank(node.outputs[0]) if node.outputs else None
        for out_axis in self._output_candidates(node, tensor, axis, out_rank):
            mapped = self.input_axes(node, out_axis)
            if mapped and (tensor, axis) in mapped:
                found = out_axis
                break
        self._forward_memo[key] = found
        return found

    def _output_candidates(
        self, node: Node, tensor: str, axis: int, out_rank: int | None
    ) -> Iterable[int]:
        """The output axes, in order, whose input axes may hold ``tensor`` at ``axis``: every
        one, but where the op tells which one it can only be."""
        if node.op_type in ALIGNED_OPS:
            # Their inputs' axes are the output's, aligned from the right.
            shape = self.shapes.shape(tensor)
            if shape is None or out_rank is None:
                return ()
            guess = axis + out_rank - len(shape)
            return (guess,) if 0 <= guess < out_rank else ()
        if node.op_type == "Transpose":
            # The first output axis whose permutation entry it is.
            perm = node.attr("perm") or list(reversed(range(out_rank or 0)))
            return (perm.index(axis),) if axis in perm else ()
        return range(out_rank or 0)

    # ------------------------------------------------------------------ per op

    def _aligned(self, inputs: tuple[str, ...], out_axis: int, out_rank: int) -> AxisList:
        result: AxisList = []
        for name in inputs:
            shape = self.shapes.shape(name) if name else None
            if shape is None:
                continue
            axis = out_axis - (out_rank - len(shape))
            if axis >= 0 and shape[axis] != 1:
                result.append((name, axis))
        return result

    def _rotary(self, node: Node, out_axis: int, out_rank: int) -> AxisList:
        """ONNX RotaryEmbedding (opset 23): its output has the shape of its input X,
        [batch, heads, S, head] or [batch, S, hidden], each position rotated by its own row
        of cos and sin: of cos_cache and sin_cache [batch, S, rotary / 2], or, with
        position_ids [batch, S], of those tables at the positions they give (each row read
        whole). Along heads and features X alone holds the axis."""
        axes: AxisList = [(node.inputs[0], out_axis)]
        if out_axis == out_rank - 1 or (out_rank == 4 and out_axis == 1):
            return axes
        along = 0 if out_axis == 0 else 1
        inputs = node.inputs
        position_ids = inputs[3] if len(inputs) > 3 and inputs[3] else None
        for name in [position_ids] if position_ids else [name for name in inputs[1:3] if name]:
            shape = self.shapes.shape(name)
            # A table of one batch row broadcasts over the batch.
            if shape is not None and along < len(shape) and shape[along] != 1:
                axes.append((name, along))
        return axes

    def _matmul(self, node: Node, out_axis: int, out_rank: int) -> AxisList | None:
        a_rank = self.shapes.rank(node.inputs[0])
        b_rank = self.shapes.rank(node.inputs[1])
        if a_rank is None or b_rank is None or a_rank < 2 or b_rank < 2:
            return None
        if out_axis == out_rank - 2:
            return [(node.inputs[0], a_rank - 2)]
        if out_axis == out_rank - 1:
            return [(node.inputs[1], b_rank - 1)]
        # A batch axis: both operands broadcast into it.
        return self._aligned(node.inputs[:2], out_axis, out_rank)

    def _einsum(self, node: Node, out_axis: int) -> AxisList | None:
        equation = node_equation(node, [self.shapes.rank(name) for name in node.inputs])
        sources = None if equation is None else equation.sources(out_axis)
        if not sources:
            return None
        # Like broadcasting, an operand's axis of 1 is not where the output's axis comes from.
        held = [(node.inputs[position], axis) for position, axis in sources]
        return [(name, axis) for name, axis in held if _dim(self.shapes, name, axis) != 1]

    def _gather(self, node: Node, out_axis: int) -> AxisList | None:
        data_rank = self.shapes.rank(node.inputs[0])
        index_rank = self.shapes.rank(node.inputs[1])
        if data_rank is None or index_rank is None:
            return None
        axis = node.attr("axis", 0) % data_rank
        if out_axis < axis:
            return [(node.inputs[0], out_axis)]
        if out_axis < axis + index_rank:
            # Rows picked at the sequence positions a NonZero selects (TorchScript's experts
            # take their tokens so): the data's sequence axis too, each row its own token's.
            if index_rank == 1 and self._selected_axis(node, axis + 1) == axis:
                return [(node.inputs[1], 0), (node.inputs[0], axis)]
            return [(node.inputs[1], out_axis - axis)]
        return [(node.inputs[0], out_axis - index_rank + 1)]

    def _gather_nd(self, node: Node, out_axis: int) -> AxisList | None:
        # Without batch dims, the output's leading axes are the indices' but their last: each
        # row of indices picks its own slice of the data (a weight every rank holds whole, as
        # the dynamo exporter's batched experts gather each token's experts' weights). The
        # indices [..., k] address the data's first k axes; the output's axes after the
        # indices' are the data's from k, copied whole (the dynamo exporter picks Falcon's
        # K and V heads out of its fused QKV so, with the sequence past them).
        indices = self.shapes.shape(node.inputs[1])
        if node.attr("batch_dims", 0) or not indices:
            return None
        if out_axis < len(indices) - 1:
            # Rows of the data picked at the sequence positions a NonZero selects (an
            # expert's tokens): the data's sequence axis too, each row its own token's.
            indexed = indices[-1]
            picked = self._selected_axis(node, indexed) if isinstance(indexed, int) else None
            if picked is not None and len(indices) == 2:
                return [(node.inputs[1], out_axis), (node.inputs[0], picked)]
            return [(node.inputs[1], out_axis)]
        indexed = indices[-1]
        if not isinstance(indexed, int):
            return None
        return [(node.inputs[0], indexed + out_axis - (len(indices) - 1))]

    def _scatter_nd(self, node: Node, out_axis: int) -> AxisList | None:
        # The indices [..., k] address the data's first k axes; past them the updates
        # (indices' leading axes, then the data's from k) are written position by position, as
        # a copy of halves of each head into a new buffer (DeepSeek's MLA K) is: such an axis
        # is the data's and the updates' own. The indexed axes are addressed by value.
        indices = self.shapes.shape(node.inputs[1])
        if indices is None or not indices or not isinstance(indices[-1], int):
            return None
        indexed = indices[-1]
        if out_axis < indexed:
            # An indexed axis the indices address as a grid of its own positions (TorchScript's
            # copy into part of a tensor) is written position by position too. The indices
            # are no input of the axis: a rank builds them from its slice's length.
            if identity_along(self.shapes, node, out_axis):
                return [(node.inputs[0], out_axis), (node.inputs[2], out_axis)]
            # Rows written back at the sequence positions a NonZero selects (an expert's
            # output added at its tokens' rows): each row is its own token's.
            if len(indices) == 2 and self._selected_axis(node, indexed) == out_axis:
                return [(node.inputs[0], out_axis), (node.inputs[1], 0), (node.inputs[2], 0)]
            return None
        return [(node.inputs[0], out_axis), (node.inputs[2], len(indices) - 1 + out_axis - indexed)]

    def _sequence_axis(self, tensor: str) -> int | None:
        """The one axis of ``tensor`` that carries a sequence, if exactly one does."""
        shape = self.shapes.shape(tensor)
        if shape is None:
            return None
        axes = [axis for axis, dim in enumerate(shape) if carries_any(dim, self.sequences)]
        return axes[0] if len(axes) == 1 else None

    def _selected_axis(self, node: Node, indexed: int) -> int | None:
        """For a GatherND or ScatterND whose indices are a NonZero's coordinates of a tensor
        with one sequence axis (selections.py): the data's axis among the ``indexed`` first
        that carries a sequence, where exactly one does."""
        axis = self._sequence_axis(node.inputs[0])
        if axis is None or axis >= indexed:
            return None
        nonzeros = selected_by(self.shapes, node.inputs[1])
        masks = [self.index.nodes[at].inputs[0] for at in nonzeros]
        if not masks or any(self._sequence_axis(mask) is None for mask in masks):
            return None
        return axis

    def _reshape(self, node: Node, out_axis: int) -> AxisList | None:
        source = self.shapes.shape(node.inputs[0])
        target = self.shapes.shape(node.outputs[0])
        if source is None or target is None:
            return None
        seq = next((dim for dim in self.sequences if carries(target[out_axis], dim)), None)
        if seq is None and is_selected_count(target[out_axis]):
            # The count of the tokens a NonZero selects: its block is followed as a
            # sequence's is.
            seq = target[out_axis]
        if seq is None:
            return None
        if isinstance(seq, int) and len(node.inputs) > 1:
            # The length is fixed (a static export): a target that spells it out, as the
            # dynamo exporter writes ViT's and CLIP's head splits, takes no rank's slice.
            spelled = self.index.constant_ints(node.inputs[1])
            if spelled is not None and out_axis < len(spelled) and spelled[out_axis] == seq:
                return None
        blocks = self._reshape_blocks.get((source, target))
        if blocks is None:
            blocks = self._reshape_blocks[source, target] = _blocks(source, target)
        for in_axes, out_axes in blocks:
            if out_axis in out_axes:
                carrying = [a for a in in_axes if carries(source[a], seq)]
                return [(node.inputs[0], carrying[0])] if len(carrying) == 1 else None
        return None

    def _unsqueeze(self, node: Node, out_axis: int, out_rank: int) -> AxisList | None:
        axes = self.index.axes_of(node)
        in_rank = self.shapes.rank(node.inputs[0])
        if axes is None or in_rank is None:
            return None
        if node.op_type == "Unsqueeze":
            inserted = {a % out_rank for a in axes}
            if out_axis in inserted:
                return None
            return [(node.inputs[0], out_axis - sum(1 for a in inserted if a < out_axis))]
        removed = sorted(a % in_rank for a in axes)
        axis = out_axis
        for a in removed:
            if a <= axis:
                axis += 1
        return [(node.inputs[0], axis)]

    def _cut_axes(self, node: Node, rank: int) -> set[int]:
        if node.op_type == "Split":
            return {node.attr("axis", 0) % rank}
        if len(node.inputs) > 3 and node.inputs[3]:
            value = self.index.constant_ints(node.inputs[3])
            if value is None:
                return set(range(rank))
            return {a % rank for a in value}
        starts = self.shapes.shape(node.inputs[1])
        count = starts[0] if starts and isinstance(starts[0], int) else rank
        return set(range(count))

    def _reduction(self, node: Node, out_axis: int, out_rank: int) -> AxisList | None:
        return self._reduced(node, out_axis, self.index.axes_of(node))

    def _reduced(self, node: Node, out_axis: int, axes: list[int] | None) -> AxisList | None:
        """The input axis of a reduction over ``axes`` that ``out_axis`` keeps."""
        in_rank = self.shapes.rank(node.inputs[0])
        if in_rank is None or axes is None:
            return None
        reduced = {a % in_rank for a in axes}
        if node.attr("keepdims", 1):
            return None if out_axis in reduced else [(node.inputs[0], out_axis)]
        kept = [a for a in range(in_rank) if a not in reduced]
        return [(node.inputs[0], kept[out_axis])] if out_axis < len(kept) else None


def _blocks(source: tuple[Dim, ...], target: tuple[Dim, ...]) -> list[tuple[list[int], list[int]]]:
    """Group the axes of a reshape into blocks of equal size (by symbols and integers)."""
    blocks: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(source) and j < len(target):
        in_axes, out_axes = [i], [j]
        left, right = size_of([source[i]]), size_of([target[j]])
        i += 1
        j += 1
        while left != right:
            if left is None or right is None:
                return blocks
            if _smaller(left, right) and i < len(source):
                in_axes.append(i)
                left = size_of([source[a] for a in in_axes])
                i += 1
            elif j < len(target):
                out_axes.append(j)
                right = size_of([target[a] for a in out_axes])
                j += 1
            else:
                return blocks
        blocks.append((in_axes, out_axes))
    return blocks


def _smaller(left: Size, right: Size) -> bool:
    if len(left[1]) != len(right[1]):
        return len(left[1]) < len(right[1])
    return left[0] < right[0]


def _dim(shapes: ShapeInference, tensor: str, axis: int) -> Dim:
    shape = shapes.shape(tensor)
    return None if shape is None else shape[axis]
