"""The extension's lengths: every node of the multi-device model gets the length it needs.

In Polygraphy's multi-device model a ``Shape`` reads what its tensor's other consumers read:
the slice of a scattered tensor, or a tensor every rank holds whole. The length then reaches
nodes that need the other one. Positions and masks are computed whole on every rank (then
scattered), so they need the whole length, which a Shape of a slice does not give
(TorchScript's ``arange(inputs_embeds.shape[1])``). The reshapes of the slices need a rank's
length, which a Shape of a whole tensor does not give (the dynamo exporter sizes every head
split by ``attention_mask.shape[1]``). So the Polygraphy-format frontier moves its cuts past
both, deep into each layer.

With the extension (``ShardHints.lengths``), ``shardcheck shard`` gives them their lengths,
taken from a scattered tensor of the hints: its Shape before the reduce-scatter is the whole
length, after it a rank's.

- What the hints scatter is computed whole: every length it is computed from is the whole one
  (the positions of TorchScript's rotary tables, read off a slice's Shape).
- ``whole_length``: the Gathers that index data every rank holds whole by positions computed
  from lengths (a padding mask gathered at the keys' positions), and the Slices of weights at
  bounds computed from lengths (a position table's rows), compute with the whole length.
  So do the nodes that compute what the hints scatter, the targets of their Reshapes and
  Expands too (transformers 4.46 fills the padding into its causal mask by a ScatterND sized by
  a slice's Shape). Their length computations are copied, so that the nodes that need the
  other length keep the originals; what no node reads any more goes.
- ``rank_length``: the Reshapes and Expands of slices whose target holds the whole length on
  the slice's axis (as the shapes on a rank show) get that entry times a rank's length over the
  whole one; inside a layer, a Reshape whose keys' entry holds a rank's length gets it times
  the whole length over a rank's, and so does an Expand's entry where its data holds the whole
  length (a table of lengths scattered before its broadcast).

``length_readers`` finds the nodes to name. Inside the attention layers the keys are whole and
the queries sliced: a Reshape or Expand of the scores sized by the whole length along its
queries gets a rank's there (the dynamo exporter's Bloom), and a Slice of a table along the
keys that the scores read gets the whole length (TorchScript's MPT slices its ALiBi bias by the
length of K before the gather); the rest of the insides are left as they are. So are the other
nodes, which the shard sizes consistently with the slices (HF's BERT expands its padding mask
over the queries by a slice's length). ``mixed_lengths`` is gen's last check: an elementwise
node broadcasting a whole length against a rank's could not run on a rank.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import cached_property, partial

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.layer_insides import key_slices, mask_broadcasts, query_axes
from shardcheck.analysis.shape_rules import apply_rule
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import always_one, is_name, mentions
from shardcheck.analysis.tensor_info import UNKNOWN, TensorInfo
from shardcheck.errors import HintsMismatchError
from shardcheck.graph import build, protos
from shardcheck.graph.index import Dim, GraphIndex, Node
from shardcheck.graph.ops import ELEMENTWISE, RESIZING_OPS, SHAPE_OPS
from shardcheck.hints.model import LengthReads, ShardHints
from shardcheck.sharding.fused import live_nodes
from shardcheck.sharding.rewrite import (
    ALL_GATHER,
    COLLECTIVE_OP,
    REDUCE_SCATTER,
    ShardedModel,
    after_scatters,
    collective_operation,
    without_nodes,
)

WHOLE, RANK = "whole", "rank"
# The nodes computing a whole tensor that the extension gives the whole length: those that
# index data by positions (a padding mask gathered at the keys' positions, from a Range over
# a slice's length). Others that read no slice keep what the shard gives them: HF's BERT
# builds its mask over the queries from a slice's length, consistent with the slices.
INDEXING_OPS = frozenset(["Gather", "GatherElements", "GatherND"])
# The input that holds the target shape, by op: a node computing a whole tensor keeps it.
TARGET_INPUT = {"Reshape": 1, "Expand": 1, "Tile": 1, "ConstantOfShape": 0}
# A rank's length in the shapes on a rank: the whole length's symbol with this appended.
ON_RANK = "_on_rank"


class _LengthGraph:
    """The multi-device model's nodes, with what each tensor is: data (computed from a graph
    input's values) or a length-like value (from shapes and constants); a slice (computed
    from a reduce-scatter) or whole. Copies the length computations on demand."""

    def __init__(
        self,
        index: GraphIndex,
        shapes: ShapeInference,
        layers: Iterable[AttentionLayer],
        hints: ShardHints,
        sharded: ShardedModel,
    ) -> None:
        self.shapes = shapes
        self.sharded = sharded
        layers = list(layers)
        self.inside = {index.nodes[at].name for layer in layers for at in layer.internal}
        self.query_axes = query_axes(index, shapes, layers)
        self.key_slices = key_slices(index, shapes, layers)
        self.mask_broadcasts = mask_broadcasts(index, shapes, layers)
        self.data: set[str] = {info.name for info in sharded.model.graph.input}
        self.weights = {init.name for init in sharded.model.graph.initializer}
        self.data -= self.weights
        self.sliced: set[str] = set()
        for node in sharded.model.graph.node:
            if node.op_type in SHAPE_OPS:
                continue
            reads = [name for name in node.input if name]
            if any(name in self.data for name in reads):
                self.data.update(node.output)
            if node.op_type == COLLECTIVE_OP:
                if collective_operation(node) == REDUCE_SCATTER:
                    self.sliced.update(node.output)
            elif any(name in self.sliced for name in reads):
                self.sliced.update(node.output)
        self.source = {tail: chain.source for tail, chain in sharded.tails.items()}
        # A scattered tensor of the hints for each length that the sequence axes carry: its
        # Shape before the reduce-scatter is the whole length, after it a rank's.
        self.references: dict[str, tuple[str, str, int]] = {}
        scattered = {
            chain.source: tail
            for tail, chain in sharded.tails.items()
            if chain.operation == REDUCE_SCATTER
        }
        # Data first: a tensor computed from shapes alone may be sized by a slice itself (a
        # buffer the size of a router's output), so its length is no reference for itself.
        for tensor in sorted(hints.inputs, key=lambda tensor: tensor.name not in self.data):
            shape = shapes.shape(tensor.name)
            if shape is None or tensor.seq_len_idx >= len(shape) or tensor.name not in scattered:
                continue
            dim = shape[tensor.seq_len_idx]
            if isinstance(dim, str):
                self.references.setdefault(
                    dim, (tensor.name, scattered[tensor.name], tensor.seq_len_idx)
                )
        self.scattered_sources = set(scattered)
        self.feeds_scatter = _feeding_scatters(sharded.model.graph.node, self.sliced)
        self.fills = _fills_for_slices(sharded.model, self.data, self.sliced)
        self.from_data = {dim for dim, (name, _, _) in self.references.items() if name in self.data}
        self.added: list[protos.NodeProto] = []
        self._copies: dict[tuple[str, str], str] = {}
        self._on_rank: ShapeInference | None = None
        self.region: frozenset[str] = frozenset()

    # Made when first asked: gen's last check (mixed_lengths) reads the shapes on a rank only,
    # and gives no node a length.
    @cached_property
    def nodes(self) -> list[protos.NodeProto]:
        """The multi-device model's nodes; ``give`` puts a changed copy in place of one (the
        model's own are never changed: a node is copied only to be changed)."""
        return list(self.sharded.model.graph.node)

    @cached_property
    def producer(self) -> dict[str, protos.NodeProto]:
        return {output: node for node in self.nodes for output in node.output}

    @cached_property
    def names(self) -> set[str]:
        """The names in use, of tensors and of nodes: a copy's are new."""
        names = {name for node in self.nodes for name in (*node.input, *node.output)}
        return names | {node.name for node in self.nodes}

    @cached_property
    def resizing(self) -> set[str]:
        """The Reshapes and Expands that may be given a rank's length."""
        return {node.name for node in self.nodes if self.wanted(node) == RANK}

    def wanted(self, node: protos.NodeProto) -> str | None:
        """The length ``node`` needs, where it may be given another: WHOLE for an indexing
        node that reads data but no slice (it computes a whole tensor), for a node computing
        what the hints scatter (its target too), for a Slice along the keys that a layer's
        scores read, and for a reduce-scatter (what it scatters is computed whole); RANK for
        a Reshape or Expand of a slice, inside a layer of its scores along their queries, and
        for an Expand of a scattered table of lengths. None for the others: the nodes
        computing lengths (part of what is given), the rest of the layers' insides, and the
        nodes whose lengths are as the shard gives them."""
        if node.op_type in SHAPE_OPS:
            return None
        if node.name in self.fills and (not self.region or node.name in self.region):
            # A buffer filled with a constant for nodes of the slice (the zeros a mixture of
            # experts scatters each expert's rows into), which the frontier's walk went
            # through (frontier/region.py): built on the rank at its length. (Read from an
            # extension, the region is not known: the nodes it names are given.)
            return RANK
        reads = [name for name in node.input if name]
        sliced = any(name in self.sliced for name in reads)
        if sliced and node.op_type == "Expand" and not any(name in self.data for name in reads):
            # A table computed from lengths, scattered before its broadcast (DeBERTa's
            # relative positions over batch and heads), in a layer or not: its target holds
            # the lengths of the slice's axes.
            return RANK
        if node.name in self.inside:
            # Inside a layer the queries are sliced and the keys whole: a Reshape of the
            # scores sized by a whole length along its queries needs a rank's there (the
            # dynamo exporter sizes Bloom's by attention_mask's length).
            wanted = sliced and node.op_type in RESIZING_OPS and node.name in self.query_axes
            return RANK if wanted else None
        if node.op_type == COLLECTIVE_OP:
            return WHOLE if collective_operation(node) == REDUCE_SCATTER else None
        if node.name in self.mask_broadcasts and not sliced:
            # A padding mask broadcast along the queries: a rank needs its rows alone,
            # whatever length the shard sizes the broadcast with; unless the hints scatter it,
            # and it is computed whole (GPT-OSS's dynamo export scatters its sinks' column).
            return None if node.output[0] in self.scattered_sources else RANK
        if node.name in self.key_slices:
            # A table sliced along the keys for a layer's scores: the keys are whole there
            # (TorchScript's MPT slices its ALiBi bias by the length of K before the gather;
            # transformers 4 its scattered mask's rows so).
            return WHOLE
        if not any(name in self.data for name in reads):
            if self._table_sliced_by_length(node):
                return WHOLE
            return None
        if not sliced:
            # A node of the region that reads no slice (a mask's Expand over the queries,
            # sized by a slice's Shape) runs on slices all the same: as the shard sizes it.
            if node.name in self.region:
                return None
            # What the hints scatter is computed whole, its targets too: transformers 4's
            # ScatterND of the padding into the causal mask, sized by a slice's Shape.
            if node.op_type not in INDEXING_OPS and node.name not in self.feeds_scatter:
                return None
            return WHOLE
        return RANK if node.op_type in RESIZING_OPS else None

    def _table_sliced_by_length(self, node: protos.NodeProto) -> bool:
        """A weight sliced off the region at bounds that may hold a sequence's length (not
        known to be numbers), computed whole on every rank: TorchScript's DeBERTa takes its
        relative embeddings' rows by the length of its Q, read off a slice. nn.Transformer's
        slices of its packed projection weight are at numbers."""
        if node.op_type != "Slice" or node.input[0] not in self.weights or node.name in self.region:
            return False
        values = [self.shapes.value(name) for name in node.input[1:3] if name]
        return any(
            value is None or not all(isinstance(dim, int) for dim in value) for value in values
        )

    def give(self, at: int, length: str) -> bool:
        """Give the node at ``at`` of ``nodes`` ``length``; whether any of its inputs changed
        (then a changed copy takes its place)."""
        node = _copied(self.nodes[at])
        changed = self._give_whole(node) if length == WHOLE else self._give_rank(node)
        if changed:
            self.nodes[at] = node
            self.producer.update((output, node) for output in node.output)
        return changed

    def _give_whole(self, node: protos.NodeProto) -> bool:
        """Recompute the length-like inputs of ``node`` with the whole length: the values it
        computes with (positions, the indices of a Gather), not a target shape. An Expand of
        a whole mask over the queries, sized by a slice's Shape, is the rank's slice of it,
        as the shard sizes it (HF's BERT expands its padding mask so)."""
        changed = False
        target = TARGET_INPUT.get(node.op_type)
        for position, name in enumerate(node.input):
            if not name or name in self.data:
                continue
            if position == target and node.name not in self.feeds_scatter:
                continue
            copy = self._copy(name, WHOLE)
            if copy != name:
                node.input[position] = copy
                changed = True
        return changed

    def _give_rank(self, node: protos.NodeProto) -> bool:
        """A Reshape's or Expand's target with each whole length along the slice's axis
        scaled to a rank's: the target's entry times a rank's length over the whole one
        (``batch*sequence`` becomes ``batch*sequence/N``)."""
        on_rank = self.on_rank()
        scaled = self._scaling(on_rank, node.name, node.input, node.op_type)
        if not scaled:
            return False
        size = len(on_rank.value(node.input[1]) or ())
        node.input[1] = self._scaled(node.input[1], size, scaled)
        return True

    def _scaling(
        self, on_rank: ShapeInference, name: str, inputs: Sequence[str], op_type: str
    ) -> dict[int, tuple[str, str]]:
        """The entries of a Reshape's or Expand's target to scale, with the symbol of the
        length each holds and the length it is to hold: RANK for those that the shapes on a
        rank show to be a whole length where the slice has a rank's; inside a layer, the entry
        of the queries' axis alone, and WHOLE for its last entry, the keys', where it holds a
        rank's length (the keys are whole there: TorchScript's XGLM views its scores by the
        length of K's reshape, before K is gathered); for an Expand, WHOLE for an entry that
        holds a rank's length where its data holds the whole one."""
        if len(inputs) < 2 or not inputs[1] or inputs[1] in self.data:
            return {}
        target = on_rank.value(inputs[1])
        data = on_rank.shape(inputs[0])
        if target is None or data is None:
            return {}
        scaled: dict[int, tuple[str, str]] = {}
        if name in self.fills:
            # Its one entry that holds a sequence's length (fills with another: no length).
            held = [
                (at, symbol)
                for at, dim in enumerate(target)
                for symbol in self.references
                if mentions(dim, symbol)
            ]
            return {held[0][0]: (held[0][1], RANK)} if len(held) == 1 else {}
        queries = self.mask_broadcasts.get(name)
        if queries is not None:
            # Of the target's entries (aligned right on the output), the queries' alone.
            at = queries - (max(len(target), len(data)) - len(target))
            if not 0 <= at < len(target):
                return {}
            held = [symbol for symbol in self.references if mentions(target[at], symbol)]
            return {at: (held[0], RANK)} if len(held) == 1 else {}
        for symbol in self.references:
            local = symbol + ON_RANK
            if not any(mentions(dim, local) for dim in data):
                continue
            whole = [at for at, dim in enumerate(target) if mentions(dim, symbol)]
            if name in self.inside:
                # The target's entries are the output's axes, an Expand's aligned right.
                out_rank = max(len(target), len(data)) if op_type == "Expand" else len(target)
                axis = self.query_axes.get(name)
                queries = None if axis is None else axis - (out_rank - len(target))
                whole = [at for at in whole if at == queries]
                keys = len(target) - 1
                if op_type == "Reshape" and keys != queries and mentions(target[keys], local):
                    scaled[keys] = (symbol, WHOLE)
            if op_type == "Expand":
                offset = len(target) - len(data)
                whole = [
                    at for at in whole if 0 <= at - offset and mentions(data[at - offset], local)
                ]
                # An entry holding a rank's length where the data holds the whole one cannot
                # expand it: TorchScript reads DeBERTa's keys' entry off the Shape of the
                # positions, which the shard computes from a slice's length.
                for at, dim in enumerate(target):
                    held = data[at - offset] if at >= offset else None
                    if (
                        at not in scaled
                        and mentions(dim, local)
                        and mentions(held, symbol)
                        and not mentions(held, local)
                    ):
                        scaled[at] = (symbol, WHOLE)
            elif len(whole) > 1:
                # A Reshape with several entries of the whole length (transformers 4's vmapped
                # masks view [batch, queries, keys] as [batch, 1, queries, keys]).
                whole = _slice_entries(target, data, symbol, local)
            scaled.update(dict.fromkeys(whole, (symbol, RANK)))
        return scaled

    def _scaled(self, target: str, size: int, scaled: dict[int, tuple[str, str]]) -> str:
        """``target`` times (the length each entry of ``scaled`` is to hold over the one it
        holds: a rank's over the whole one, or back) at those entries: a Mul and a Div by
        vectors that hold 1 elsewhere, exact on integers."""
        factors = []
        for to in (True, False):
            pieces = []
            for at in range(size):
                entry = scaled.get(at)
                if entry is None:
                    pieces.append(self._constant([1]))
                    continue
                symbol, length = entry
                held = length if to else (WHOLE if length == RANK else RANK)
                pieces.append(self._read(self.references[symbol], held))
            vector = self._new(f"{target}/{RANK if to else WHOLE}_length_factor")
            self.added.append(
                build.make_node("Concat", pieces, [vector], name=self._new(vector), axis=0)
            )
            factors.append(vector)
        times = self._new(f"{target}/times_rank_length")
        self.added.append(
            build.make_node("Mul", [target, factors[0]], [times], name=self._new(times))
        )
        result = self._new(f"{target}/rank_length")
        self.added.append(
            build.make_node("Div", [times, factors[1]], [result], name=self._new(result))
        )
        return result

    def _constant(self, values: list[int]) -> str:
        key = (f"\0constant{values}", "")
        known = self._copies.get(key)
        if known is None:
            known = self._new("shardcheck/length_one")
            tensor = build.int64_tensor(known, [len(values)], values)
            self.added.append(
                build.make_node("Constant", [], [known], name=self._new(known), value=tensor)
            )
            self._copies[key] = known
        return known

    def on_rank(self) -> ShapeInference:
        """The shapes of the multi-device model on a rank: a reduce-scatter gives its axis a
        rank's length (the symbol with ON_RANK appended), an all-gather the whole one, and
        the Reshapes and Expands to be given a rank's length (``self.resizing``) have it, so
        that what follows them is inferred as it will be."""
        if self._on_rank is None:
            model = self.sharded.model
            # What the model declares holds for one device: not for what a scatter reaches.
            affected = after_scatters(model.graph.node)
            index = GraphIndex(model, source="<the multi-device model>", undeclared=affected)
            rules = dict.fromkeys(RESIZING_OPS, self._resized)
            rules[COLLECTIVE_OP] = partial(_collective_on_rank, tuple(self.references))
            self._on_rank = ShapeInference(index, rules)
        return self._on_rank

    def drop_shapes_on_rank(self) -> None:
        """Free the shapes on a rank (on_rank makes them again if asked)."""
        self._on_rank = None

    def _resized(self, shapes: ShapeInference, node: Node) -> list[TensorInfo] | None:
        scaled = (
            self._scaling(shapes, node.name, node.inputs, node.op_type)
            if node.name in self.resizing
            else {}
        )
        if not scaled:
            return apply_rule(shapes, node)
        target = node.inputs[1]
        info = shapes.info[target]
        value = list(info.value or ())
        for at, (symbol, length) in scaled.items():
            value[at] = (
                _on_rank_dim(value[at], symbol) if length == RANK else _whole_dim(value[at], symbol)
            )
        shapes.info[target] = TensorInfo(info.shape, tuple(value))
        try:
            return apply_rule(shapes, node)
        finally:
            shapes.info[target] = info

    def _copy(self, tensor: str, length: str) -> str:
        """``tensor`` computed with ``length`` (itself, when that changes nothing)."""
        key = (tensor, length)
        known = self._copies.get(key)
        if known is not None:
            return known
        self._copies[key] = tensor  # guards against cycles in malformed graphs
        producer = self.producer.get(tensor)
        result = tensor
        if producer is None or producer.op_type in ("Constant", COLLECTIVE_OP):
            pass
        elif producer.op_type in SHAPE_OPS and producer.input[0] not in self.data:
            # The Shape of a tensor computed from lengths (a mask made from Ranges): the
            # Shape of its copy.
            read = self._copy(producer.input[0], length)
            if read != producer.input[0]:
                result = self._new(f"{tensor}/{length}_length")
                copy = _copied(producer)
                copy.input[0] = read
                copy.output[0] = result
                copy.name = self._new(result)
                self.added.append(copy)
        elif producer.op_type == "Shape":
            result = self._shape(producer, length)
        elif producer.op_type not in SHAPE_OPS and not any(
            name in self.data for name in producer.input if name
        ):
            inputs = [self._copy(name, length) if name else name for name in producer.input]
            if inputs != list(producer.input):
                copy = protos.NodeProto()
                copy.CopyFrom(producer)
                del copy.input[:]
                copy.input.extend(inputs)
                del copy.output[:]
                copy.output.extend(self._new(f"{out}/{length}_length") for out in producer.output)
                copy.name = self._new(copy_name(producer.name, length))
                self.added.append(copy)
                for out, new in zip(producer.output, copy.output, strict=True):
                    self._copies[(out, length)] = new
                result = self._copies[key]
        self._copies[key] = result
        return result

    def _shape(self, node: protos.NodeProto, length: str) -> str:
        """A Shape's output with each length along the sequence taken from a reference."""
        read = node.input[0]
        shape = self.shapes.shape(self.source.get(read, read))
        if shape is None:
            return node.output[0]
        start, end = _bounds(node, len(shape))
        given = RANK if read in self.sliced else WHOLE
        # A tensor computed whole from what a rank_length node resized holds a rank's length
        # there (ModernBERT's global mask expanded over a rank's queries, whose Shape sizes
        # the sliding window's positions).
        on_rank = self.on_rank().shape(read) if given == WHOLE and self.resizing else None
        pieces: list[str] = []
        changed = False
        for axis in range(start, end):
            dim = shape[axis]
            reference = self.references.get(dim) if isinstance(dim, str) else None
            here = given
            if on_rank is not None and axis < len(on_rank) and isinstance(dim, str):
                if mentions(on_rank[axis], dim + ON_RANK):
                    here = RANK
            if reference is not None and here != length:
                product = None if dim in self.from_data else self._product(dim, length)
                pieces.append(product or self._read(reference, length))
                changed = True
            else:
                pieces.append(self._dim(read, axis, here))
        if not changed:
            return node.output[0]
        if len(pieces) == 1:
            return pieces[0]
        output = self._new(f"{node.output[0]}/{length}_length")
        self.added.append(
            build.make_node("Concat", pieces, [output], name=self._new(output), axis=0)
        )
        return output

    def _product(self, dim: str, length: str) -> str | None:
        """A product of lengths (``batch*sequence``, flattened tokens) with ``length``,
        multiplied from its factors as the data tensors scattered hold them; None where a
        factor is held by none."""
        factors = dim.split("*")
        if len(factors) < 2:
            return None
        pieces: list[str] = []
        for factor in factors:
            reference = self.references.get(factor)
            if reference is not None:
                if factor not in self.from_data:
                    return None  # a length that no data tensor scattered holds
                pieces.append(self._read(reference, length))
                continue
            held = self._held(factor)  # a dim no rank splits (the batch): read as it is
            if held is None:
                return None
            pieces.append(self._dim(*held, WHOLE))
        product = pieces[0]
        for piece in pieces[1:]:
            output = self._new(f"{dim}/{length}_length")
            self.added.append(
                build.make_node("Mul", [product, piece], [output], name=self._new(output))
            )
            product = output
        return product

    def _held(self, factor: str) -> tuple[str, int] | None:
        """A data tensor scattered, and an axis of it other than the scattered one, that holds
        ``factor``."""
        for tensor, _, at in self.references.values():
            shape = self.shapes.shape(tensor) if tensor in self.data else None
            for axis, dim in enumerate(shape or ()):
                if dim == factor and axis != at:
                    return tensor, axis
        return None

    def _read(self, reference: tuple[str, str, int], length: str) -> str:
        """``length`` read off a reference: the Shape of its scattered tensor before the
        reduce-scatter (the whole length) or after it (a rank's), on its axis."""
        whole, scattered, axis = reference
        return self._dim(whole if length == WHOLE else scattered, axis, length)

    def _dim(self, tensor: str, axis: int, length: str) -> str:
        key = (f"{tensor}\0{axis}", length)
        known = self._copies.get(key)
        if known is None:
            known = self._new(f"{tensor}/{length}_length_{axis}")
            opset = build.onnx_opset(self.sharded.model)
            self.added.extend(build.dim_nodes(tensor, axis, known, self._new(known), opset))
            self._copies[key] = known
        return known

    def _new(self, wanted: str) -> str:
        name, counter = wanted, 1
        while name in self.names:
            counter += 1
            name = f"{wanted}_{counter}"
        self.names.add(name)
        return name

    def model(self) -> ShardedModel:
        """The multi-device model with the copies, in a topological order."""
        model = without_nodes(self.sharded.model, counted_only=self.sharded.counted_only)
        ordered = _sorted([*self.nodes, *self.added], model.graph)
        # The originals that only the nodes given other lengths read go.
        outputs = [info.name for info in model.graph.output]
        model.graph.node.extend(live_nodes(ordered, outputs))
        return replace(self.sharded, model=model)


def length_readers(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: Iterable[AttentionLayer],
    hints: ShardHints,
    sharded: ShardedModel,
    region: Iterable[int],
) -> tuple[LengthReads, ShardedModel]:
    """The nodes of ``sharded`` (the multi-device model of ``hints``, without the extension)
    that its Shapes give another length than the one they need, and ``sharded`` with them
    given their lengths: the model that ``shard_model`` makes of ``hints`` with these
    lengths, made once here for gen's weighing; ``region``: the nodes of the model that run
    on slices before the layers (the frontier's, by index)."""
    graph = _LengthGraph(index, shapes, layers, hints, sharded)
    graph.region = frozenset(index.nodes[at].name for at in region)
    found = _give(graph, None)
    return LengthReads(whole=tuple(found[WHOLE]), rank=tuple(found[RANK])), graph.model()


def give_lengths(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: Iterable[AttentionLayer],
    hints: ShardHints,
    sharded: ShardedModel,
    hints_source: str,
) -> ShardedModel:
    """``sharded`` with the nodes that ``hints.lengths`` names given their lengths, and what
    it scatters computed with the whole length."""
    lengths = hints.lengths
    if lengths is None:
        return sharded
    graph = _LengthGraph(index, shapes, layers, hints, sharded)
    by_name = {node.name: node for node in graph.nodes}
    named = {WHOLE: set(lengths.whole), RANK: set(lengths.rank)}
    for key, names, length in (
        ("whole_length", lengths.whole, WHOLE),
        ("rank_length", lengths.rank, RANK),
    ):
        for position, name in enumerate(names):
            node = by_name.get(name)
            problem = None
            if node is None or node.op_type == COLLECTIVE_OP:
                problem = f"is not a node of the model {index.source}"
            elif graph.wanted(node) != length:
                problem = _WHY_NOT[length]
            if problem is not None:
                raise HintsMismatchError(f"{hints_source}: {key}[{position}]: {name!r} {problem}")
    graph.resizing &= named[RANK]
    _give(graph, named)
    return graph.model()


def mixed_lengths(
    index: GraphIndex, shapes: ShapeInference, hints: ShardHints, sharded: ShardedModel
) -> str | None:
    """The first node of ``sharded`` (a multi-device model of ``hints``) that the shapes on a
    rank show to mix lengths: the producer of a tensor the hints scatter that has a rank's
    length along its axis already, or an elementwise node that broadcasts a whole length
    against a rank's on one axis: on a rank it cannot run. gen offers no extension whose model
    has one. None when no node does."""
    graph = _LengthGraph(index, shapes, (), hints, sharded)
    graph.resizing = set()
    on_rank = graph.on_rank()
    symbols = list(graph.references)
    for tensor in hints.inputs:
        # What a rank scatters must be whole along its axis: a rank's length there (a buffer
        # sized by a slice, scattered as if computed whole) would be scattered twice.
        shape = on_rank.shape(tensor.name)
        dim = shape[tensor.seq_len_idx] if shape and tensor.seq_len_idx < len(shape) else None
        if any(mentions(dim, symbol + ON_RANK) for symbol in symbols):
            producer = on_rank.index.producer_of(tensor.name)
            return producer.name if producer is not None else tensor.name
    for node in on_rank.index.nodes:
        if node.op_type == "Reshape" and _reshapes_lengths(on_rank, node, symbols):
            return node.name
        if node.op_type not in ELEMENTWISE:
            continue
        known = [shape for shape in map(on_rank.shape, node.inputs) if shape]
        if len(known) < 2:
            continue
        rank = max(len(shape) for shape in known)
        for axis in range(1, rank + 1):
            # A dim the exporter spells as an expression of the length that is 1 (dynamo's
            # "1 - Max(0, 1 - sequence)") broadcasts.
            dims = [shape[-axis] for shape in known if len(shape) >= axis]
            dims = [dim for dim in dims if not always_one(dim)]
            for symbol in symbols:
                whole = any(mentions(dim, symbol) for dim in dims)
                if whole and any(mentions(dim, symbol + ON_RANK) for dim in dims):
                    return node.name
    return None


def _reshapes_lengths(on_rank: ShapeInference, node: Node, symbols: list[str]) -> bool:
    """Whether the Reshape ``node`` turns a rank's length into the whole one, or back, as the
    shapes on a rank show: a Reshape keeps the number of elements, so its data and its target
    hold each length as often (a mask of a rank's rows viewed with the whole length along its
    queries cannot run). Only where the target is known, no entry 0 or -1."""
    data = on_rank.shape(node.inputs[0])
    target = on_rank.value(node.inputs[1]) if len(node.inputs) > 1 else None
    if data is None or target is None or any(entry in (0, -1) for entry in target):
        return False
    for symbol in symbols:
        lengths = (symbol, symbol + ON_RANK)
        before = [sum(mentions(dim, length) for dim in data) for length in lengths]
        after = [sum(mentions(dim, length) for dim in target) for length in lengths]
        # As many entries of a length on both sides, not split alike: an entry the shapes
        # cannot name (where the totals differ) tells nothing.
        if sum(before) == sum(after) and before != after:
            return True
    return False


_WHY_NOT = {
    WHOLE: "is no node that computes a whole tensor (one that reads data, none of it a slice)",
    RANK: "is no Reshape or Expand of a slice (in an attention layer: of its scores)",
}


def _give(graph: _LengthGraph, named: dict[str, set[str]] | None) -> dict[str, list[str]]:
    """Give the nodes their lengths (those of ``named``, or every one that needs another),
    the reduce-scatters theirs always; the nodes, other than those, whose inputs changed.
    The Reshapes and Expands first: the shapes on a rank are of the model as sharded."""
    found: dict[str, list[str]] = {WHOLE: [], RANK: []}
    for length in (RANK, WHOLE):
        for at, node in enumerate(graph.nodes):
            if graph.wanted(node) != length:
                continue
            implicit = node.op_type == COLLECTIVE_OP
            if not implicit and named is not None and node.name not in named[length]:
                continue
            if graph.give(at, length) and not implicit:
                found[length].append(node.name)
    # Done with the shapes on a rank: freed before model() copies the nodes, not held beside
    # them (on a deep model they are most of the peak memory of gen's weighing).
    graph.drop_shapes_on_rank()
    return found


def _fills_for_slices(model: protos.ModelProto, data: set[str], sliced: set[str]) -> frozenset[str]:
    """The Expands of a constant of one element (a fill) to a target computed from lengths,
    whose output a node reading a slice reads: a buffer the rank's nodes write their rows
    into, which the extension's frontier leaves to the rank to build (frontier/region.py)."""
    graph = model.graph
    expands = [
        node
        for node in graph.node
        if node.op_type == "Expand" and len(node.input) > 1 and node.input[1] not in data
    ]
    if not expands:
        return frozenset()
    filled = {node.input[0] for node in expands}
    small = {
        tensor.name
        for tensor in graph.initializer
        if tensor.name in filled and math.prod(tensor.dims) <= 1
    }
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] in filled:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and math.prod(value.dims) <= 1:
                small.add(node.output[0])
    fills = {node.output[0]: node.name for node in expands if node.input[0] in small}
    if not fills:
        return frozenset()
    # Each fill is kept while every node that reads it reads a slice too.
    read: set[str] = set()
    refused: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name in fills:
                read.add(name)
                if node.op_type == COLLECTIVE_OP or not any(i in sliced for i in node.input):
                    refused.add(name)
    return frozenset(fills[name] for name in read - refused)


def _feeding_scatters(nodes: Iterable[protos.NodeProto], sliced: set[str]) -> set[str]:
    """The nodes that compute what a reduce-scatter scatters, reading no slice: back from
    each reduce-scatter to the Shapes, whose lengths are what is given."""
    producer = {output: node for node in nodes for output in node.output}
    found: set[str] = set()
    todo = [
        node.input[0]
        for node in nodes
        if node.op_type == COLLECTIVE_OP and collective_operation(node) == REDUCE_SCATTER
    ]
    while todo:
        node = producer.get(todo.pop())
        if node is None or node.name in found or node.op_type in SHAPE_OPS:
            continue
        if node.op_type == COLLECTIVE_OP or any(name in sliced for name in node.input):
            continue
        found.add(node.name)
        todo.extend(name for name in node.input if name)
    return found


def _slice_entries(
    target: Sequence[Dim], data: Sequence[Dim], symbol: str, local: str
) -> list[int]:
    """Of a Reshape's ``target``, the entries of the whole length that are the slice's axis:
    a Reshape keeps the elements' order, so the target's entries holding a length (the whole
    one or a rank's) are the data's axes holding one, in the same order, where they are as
    many and no axis holds both; none where that does not tell."""

    def holds(dim: Dim) -> bool:
        return mentions(dim, symbol) or mentions(dim, local)

    if any(mentions(dim, symbol) and mentions(dim, local) for dim in (*target, *data)):
        return []
    entries = [at for at, dim in enumerate(target) if holds(dim)]
    axes = [dim for dim in data if holds(dim)]
    if len(entries) != len(axes):
        return []
    return [
        at
        for at, axis in zip(entries, axes, strict=True)
        if mentions(axis, local) and mentions(target[at], symbol)
    ]


def _on_rank_dim(dim: Dim, symbol: str) -> Dim:
    """``dim`` with its length ``symbol`` made a rank's."""
    if not isinstance(dim, str):
        return dim
    return re.sub(rf"\b{re.escape(symbol)}\b", symbol + ON_RANK, dim)


def copy_name(node: str, length: str) -> str:
    """The name of the copy of ``node`` computed with ``length`` (a number follows it where
    the name is taken)."""
    return f"{node}/{length}_length"


_COPY_NAME = re.compile(rf"(.*)/(?:{WHOLE}|{RANK})_length(?:_\d+)?")


def copied_node(name: str) -> str | None:
    """The name of the node that the node named ``name`` may be a copy of (``copy_name``):
    None where it is named as no copy is."""
    matched = _COPY_NAME.fullmatch(name)
    return matched.group(1) if matched else None


def _whole_dim(dim: Dim, symbol: str) -> Dim:
    """``dim`` with a rank's length of ``symbol`` made the whole one."""
    if not isinstance(dim, str):
        return dim
    return re.sub(rf"\b{re.escape(symbol + ON_RANK)}\b", symbol, dim)


def _copied(node: protos.NodeProto) -> protos.NodeProto:
    copy = protos.NodeProto()
    copy.CopyFrom(node)
    return copy


def _collective_on_rank(
    symbols: tuple[str, ...], shapes: ShapeInference, node: Node
) -> list[TensorInfo] | None:
    """A collective's output on a rank, along its axis 0: a reduce-scatter's has a rank's
    length, an all-gather's the whole one. A length merged with others (the flattened tokens
    [batch*sequence, hidden] of transformers 4's experts) is a rank's where it is the one
    length of ``symbols`` in it."""
    shape = shapes.input_info(node, 0).shape
    if not shape:
        return [UNKNOWN]
    operation = collective_operation(node.proto)
    first = shape[0]
    if operation == REDUCE_SCATTER:
        # What a reduce-scatter scatters is computed with the whole length (``_give``), even
        # where the model as sharded sizes it by a slice (DeBERTa's relative positions).
        shape = tuple(dim.replace(ON_RANK, "") if isinstance(dim, str) else dim for dim in shape)
        first = shape[0]
        merged = [symbol for symbol in symbols if is_name(symbol) and mentions(first, symbol)]
        if isinstance(first, str) and is_name(first):
            first = first + ON_RANK
        else:
            first = _on_rank_dim(first, merged[0]) if len(merged) == 1 else None
    elif operation == ALL_GATHER:
        local = isinstance(first, str) and first.endswith(ON_RANK)
        first = first[: -len(ON_RANK)] if local else None  # type: ignore[index]
    return [TensorInfo((first, *shape[1:]))]


def _bounds(node: protos.NodeProto, rank: int) -> tuple[int, int]:
    """A Shape's ``start`` and ``end`` (opset 15), clamped as the operator clamps them."""
    start, end = 0, rank
    for attribute in node.attribute:
        if attribute.name == "start":
            start = attribute.i
        elif attribute.name == "end":
            end = attribute.i
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = max(0, min(rank, end + rank if end < 0 else end))
    return start, end


def _sorted(nodes: list[protos.NodeProto], graph: protos.GraphProto) -> list[protos.NodeProto]:
    """``nodes`` in a topological order: of the nodes whose inputs are ready, the first in
    ``nodes`` goes first (the original order where it already is one)."""
    made = {output: at for at, node in enumerate(nodes) for output in node.output if output}
    waits = [0] * len(nodes)
    followers: list[list[int]] = [[] for _ in nodes]
    for at, node in enumerate(nodes):
        for before in {made[name] for name in node.input if name in made}:
            if before != at:
                waits[at] += 1
                followers[before].append(at)
    ready = [at for at, count in enumerate(waits) if count == 0]
    heapq.heapify(ready)
    ordered: list[protos.NodeProto] = []
    while ready:
        at = heapq.heappop(ready)
        ordered.append(nodes[at])
        for follower in followers[at]:
            waits[follower] -= 1
            if waits[follower] == 0:
                heapq.heappush(ready, follower)
    if len(ordered) < len(nodes):  # a cycle in a malformed graph: the rest as it was
        placed = {id(node) for node in ordered}
        ordered.extend(node for node in nodes if id(node) not in placed)
    return ordered
