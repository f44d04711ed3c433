"""The multi-device model for context parallelism, as Polygraphy 0.53.6's ``multi-device shard``.

For native CP, in this order:

1. every hinted input (any tensor of the model) gets a ``reduce_scatter`` ``DistCollective``
   and all its consumers read the scattered tensor;
2. every hinted attention layer (found by its Q, after step 1) all-gathers Q when ``gather_q``,
   K (the score MatMul's second input, ``k_seq_len_idx``) and V (the context MatMul's second
   input, ``v_seq_len_idx``) when ``gather_kv``; a tensor is gathered once;
3. unless a layer gathers Q (or gathers K/V that are its Q), every hinted output is all-gathered;
   a graph output that is gathered is replaced by the gathered tensor. An output the
   extension gathers for the graph output only (``gathered_for_output``) keeps its other
   consumers on the rank's slice.

A layer hinted with ``replace`` (``cp-type fused``) is not gathered: it becomes one fused
multi-device ``Attention`` instead (``fused.py``), the nodes it replaces and what only they read
removed.

A collective on an axis other than 0 is wrapped in two Transposes that swap that axis with 0
(NCCL collectives work on axis 0). Layers are the ones shardcheck detects, not only Polygraphy's
two patterns. Unlike Polygraphy, the nodes come out topologically sorted, a K or V shared by two
layers is gathered once, an unknown tensor or an unmatched Q is an error, and a gathered graph
output keeps its declared type and shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from google.protobuf.message import Message

from shardcheck.analysis.detect import AttentionLayer, detect_attention, gathered_by_q
from shardcheck.analysis.fusion import FusedSite
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.tensor_info import MAX_VALUE_ELEMENTS
from shardcheck.errors import HintsMismatchError
from shardcheck.graph import build, protos
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.tensors import INTEGER_TYPES
from shardcheck.hints.codec import validated
from shardcheck.hints.model import (
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ReaderGather,
    ShardHints,
)
from shardcheck.sharding.fused import fused_attention_attributes, fused_sites, live_nodes
from shardcheck.sharding.inlined import planned_index

COLLECTIVE_OP = "DistCollective"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
# Slot of the tensors that exist before the first node: graph inputs and initializers.
BEFORE_FIRST_NODE = -1


@dataclass(frozen=True)
class ChainTail:
    """A tensor the shard created that stands for a tensor of the original model."""

    source: str  # the original tensor it stands for
    operation: str  # REDUCE_SCATTER or ALL_GATHER
    collective_node: str  # name of the DistCollective node that made it
    axis: int  # the sequence axis the collective works on (through the Transposes)


@dataclass(frozen=True)
class ShardedModel:
    """The multi-device model and what its new tensors stand for."""

    model: protos.ModelProto
    tails: dict[str, ChainTail] = field(default_factory=dict)
    # Original graph output -> the graph output of the sharded model that replaces it.
    outputs: dict[str, str] = field(default_factory=dict)
    # Made without its weights (shard_model(weights=False)): counted, never run or written.
    counted_only: bool = False


def collective_operation(node: protos.NodeProto) -> str:
    """A DistCollective's ``collective_operation`` (REDUCE_SCATTER, ALL_GATHER, ...)."""
    for attribute in node.attribute:
        if attribute.name == "collective_operation":
            return attribute.s.decode()
    return ""


def after_scatters(nodes: Iterable[protos.NodeProto]) -> set[str]:
    """The tensors computed from a scattered one (through shapes too), nodes in graph order."""
    affected: set[str] = set()
    for node in nodes:
        if node.op_type == COLLECTIVE_OP and collective_operation(node) == REDUCE_SCATTER:
            affected.update(node.output)
        elif not affected.isdisjoint(node.input):
            affected.update(node.output)
    return affected


def collective_attributes(dist: DistCollective, operation: str) -> list[protos.AttributeProto]:
    """The attributes Polygraphy writes on a DistCollective, in its order."""
    reduce_op = dist.reduce_op if operation == REDUCE_SCATTER else "none"
    return [
        build.make_attribute("group_size", dist.group_size),
        build.make_attribute("root", dist.root),
        build.make_attribute("nb_rank", dist.nb_rank),
        build.make_attribute("reduce_op", reduce_op),
        build.make_attribute("collective_operation", operation),
        build.make_attribute("groups", list(dist.groups)),
    ]


class _Rewriter:
    """Inserts chains of nodes after a tensor and moves every consumer to the chain's tail."""

    def __init__(
        self,
        index: GraphIndex,
        hints: ShardHints,
        hints_source: str,
        shapes: ShapeInference | None = None,
    ) -> None:
        self.index = index
        self.hints = hints
        self.hints_source = hints_source
        # The model's nodes, each replaced by a copy where a consumer is moved (the model's own
        # are never changed; most are not, and copying them all would double the memory).
        self.nodes = [node.proto for node in index.nodes]
        self._copied: set[int] = set()
        self.inserted: dict[int, list[protos.NodeProto]] = {}
        self.slot: dict[str, int] = dict.fromkeys(index.input_infos, BEFORE_FIRST_NODE)
        self.slot.update(dict.fromkeys(index.initializers, BEFORE_FIRST_NODE))
        self.slot.update(index.producer)
        # Each use of a tensor: (its reader, the input's position); the reader is a position in
        # ``nodes`` for the model's nodes, the node itself for one inserted.
        self.consumers: dict[str, list[tuple[int | protos.NodeProto, int]]] = {}
        for at, proto in enumerate(self.nodes):
            self._add_uses(proto, at)
        self.graph_outputs = list(index.graph_outputs)
        self.tensor_names = set(index.all_tensor_names())
        self.node_names = {node.name for node in index.nodes}
        # Original tensor -> the tensor its consumers read now.
        self.current: dict[str, str] = {}
        self.tails: dict[str, ChainTail] = {}
        self.new_value_infos: list[protos.ValueInfoProto] = []
        self._shapes = shapes
        # Positions of the nodes a fused Attention replaced.
        self.removed: set[int] = set()

    # ----------------------------------------------------------------- chains

    def collective(
        self,
        source: str,
        operation: str,
        axis: int,
        rank: int | None,
        what: str,
        fields: tuple[str, str] = ("seq_len_idx", "rank"),
        *,
        for_output: bool = False,
        readers: frozenset[str] | None = None,
    ) -> None:
        """Scatter or gather ``source`` (as its consumers now read it) along ``axis``;
        ``fields``: the hints' names of ``axis`` and ``rank``, for messages. ``for_output``:
        only the graph output takes the collective's result; the consumers read what they did.
        ``readers``: only the nodes of these names take it (not the graph output)."""
        head = self.current.get(source, source)
        moving: bool | frozenset[str] = readers if readers is not None else not for_output
        perm = None if axis == 0 else self._swap(source, axis, rank, what, fields)
        name = f"{source}/{operation}"
        tensor = head
        if perm is not None:
            tensor = self._extend(
                tensor, f"{name}/axis{axis}_to_0", source, perm=perm, moving=moving
            )
        on_axis0 = name if perm is None else f"{name}/on_axis0"
        tensor = self._extend(tensor, on_axis0, source, operation=operation, moving=moving)
        collective_node = self.inserted[self.slot[tensor]][-1].name
        if perm is not None:
            tensor = self._extend(tensor, name, source, perm=perm, moving=moving)
        if moving is True:
            self.current[source] = tensor
        self.tails[tensor] = ChainTail(source, operation, collective_node, axis)

    def _extend(
        self,
        head: str,
        wanted_name: str,
        source: str,
        *,
        operation: str | None = None,
        perm: list[int] | None = None,
        moving: bool | frozenset[str] = True,
    ) -> str:
        """Insert a collective (``operation``) or a Transpose (``perm``) after ``head``;
        ``moving``: its consumers read the new tensor (False: only the graph output does; a
        set of node names: only those nodes do)."""
        tail = _unique(wanted_name, self.tensor_names)
        node_name = _unique(tail, self.node_names)
        if operation is not None:
            node = build.make_node(COLLECTIVE_OP, [head], [tail], name=node_name)
            node.attribute.extend(collective_attributes(self.hints.dist_collectives, operation))
        else:
            node = build.make_node("Transpose", [head], [tail], name=node_name, perm=perm)
        if moving is not False:
            kept = []
            for consumer, position in self.consumers.pop(head, []):
                reader = self.nodes[consumer] if isinstance(consumer, int) else consumer
                if moving is True or reader.name in moving:
                    self._writable(consumer).input[position] = tail
                    self.consumers.setdefault(tail, []).append((consumer, position))
                else:
                    kept.append((consumer, position))
            if kept:
                self.consumers[head] = kept
        self._add_uses(node)
        slot = self.slot[head]
        self.inserted.setdefault(slot, []).append(node)
        self.slot[tail] = slot
        if not isinstance(moving, frozenset):
            self.graph_outputs = [tail if name == head else name for name in self.graph_outputs]
        elem_type = self.index.elem_type(source)
        if elem_type:
            self.new_value_infos.append(build.tensor_value_info(tail, elem_type))
        return tail

    def _swap(
        self, source: str, axis: int, hinted_rank: int | None, what: str, fields: tuple[str, str]
    ) -> list[int]:
        axis_field, rank_field = fields
        where = f"{self.hints_source}: {what}"
        rank = self._rank(source)
        if rank is not None and hinted_rank is not None and hinted_rank != rank:
            # The Transposes would be written for the hinted rank: a model that cannot run.
            raise HintsMismatchError(
                f"{where}: {rank_field} {hinted_rank} is given, but {source!r} has rank {rank}"
            )
        rank = rank or hinted_rank
        if rank is None:
            raise HintsMismatchError(
                f"{where}: {axis_field} {axis} needs the rank of {source!r}, but the model "
                f"declares no shape for it and the hint gives no {rank_field}: write its "
                f"number of axes as the hint's {rank_field}"
            )
        if axis >= rank:
            raise HintsMismatchError(
                f"{where}: {axis_field} {axis} is out of range for {source!r} of rank {rank}"
            )
        perm = list(range(rank))
        perm[0], perm[axis] = axis, 0
        return perm

    def _rank(self, tensor: str) -> int | None:
        rank = self.index.rank(tensor)
        if rank is not None:
            return rank
        if self._shapes is None:
            self._shapes = ShapeInference(self.index)
        return self._shapes.rank(tensor)

    def fuse(self, site: FusedSite, fused: FusedAttention) -> None:
        """Replace the nodes of ``site`` with one Attention reading its Q, K and V (as their
        consumers now read them) through the shuffles' Transposes, as Polygraphy does; it makes
        the layer's output under the same name. Nothing else reads the Transposes."""
        inputs = []
        for source, shuffle in (
            (site.q, fused.q_shuffle),
            (site.k, fused.k_shuffle),
            (site.v, fused.v_shuffle),
        ):
            head = self.current.get(source, source)
            if shuffle:
                tail = _unique(f"{source}/fused_shuffle", self.tensor_names)
                node = build.make_node(
                    "Transpose",
                    [head],
                    [tail],
                    name=_unique(tail, self.node_names),
                    perm=list(shuffle),
                )
                self._place(node, self.slot[head], source)
                head = tail
            inputs.append(head)
        position = self.index.producer[site.output]
        node = build.make_node(
            "Attention",
            inputs,
            [site.output],
            name=_unique(f"{site.output}/fused_attention", self.node_names),
        )
        node.attribute.extend(fused_attention_attributes(fused, site.scale))
        self.removed.update(site.replaced)
        self._add_uses(node)
        self.inserted.setdefault(position, []).append(node)

    def _place(self, node: protos.NodeProto, slot: int, source: str) -> None:
        self._add_uses(node)
        self.inserted.setdefault(slot, []).append(node)
        tail = node.output[0]
        self.slot[tail] = slot
        elem_type = self.index.elem_type(source)
        if elem_type:
            self.new_value_infos.append(build.tensor_value_info(tail, elem_type))

    # ----------------------------------------------------------------- bookkeeping

    def _add_uses(self, proto: protos.NodeProto, at: int | None = None) -> None:
        """Record the uses of ``proto``'s inputs: the model's node at ``at`` of ``nodes``, or
        one inserted (``at`` None)."""
        reader = proto if at is None else at
        for position, name in enumerate(proto.input):
            if name:
                self.consumers.setdefault(name, []).append((reader, position))

    def _writable(self, reader: int | protos.NodeProto) -> protos.NodeProto:
        """The node of a use, to change: an inserted one as it is, the model's a copy of it
        (made once) in its place in ``nodes``."""
        if not isinstance(reader, int):
            return reader
        if reader not in self._copied:
            self.nodes[reader] = _copy(self.nodes[reader])
            self._copied.add(reader)
        return self.nodes[reader]

    def sorted_nodes(self) -> list[protos.NodeProto]:
        ordered = list(self.inserted.get(BEFORE_FIRST_NODE, []))
        for position, proto in enumerate(self.nodes):
            if position not in self.removed:
                ordered.append(proto)
            ordered.extend(self.inserted.get(position, []))
        if self.removed:
            # What only the replaced nodes read (a causal mask's making) goes too, as in
            # Polygraphy (its graph cleanup).
            return live_nodes(ordered, self.graph_outputs)
        return ordered


def _unique(wanted: str, used: set[str]) -> str:
    name, counter = wanted, 1
    while name in used:
        counter += 1
        name = f"{wanted}_{counter}"
    used.add(name)
    return name


def _copy(proto: protos.NodeProto) -> protos.NodeProto:
    copy = protos.NodeProto()
    copy.CopyFrom(proto)
    return copy


def shard_model(
    index: GraphIndex,
    hints: ShardHints,
    layers: dict[str, list[tuple[str, str]]] | None = None,
    *,
    hints_source: str = "<hints>",
    shapes: ShapeInference | None = None,
    detected: list[AttentionLayer] | None = None,
    weights: bool = True,
    for_output: tuple[str, ...] | None = None,
    for_readers: tuple[ReaderGather, ...] | None = None,
) -> ShardedModel:
    """The CP multi-device model of ``index`` for ``hints`` (pure: no files are touched).

    ``layers`` maps a Q to the gathered K and V of each attention layer that reads it
    (default: ``shardcheck.analysis.detect``); ``shapes``: the model's, when already inferred;
    ``detected``: the model's layers, when already found (the fused replacements need them).
    ``weights=False``: a model to count, not to run or write (gen's plans): its initializers
    keep their names, types and dims, and their data only where shapes are computed from it.
    ``for_output``: the outputs gathered for the graph output alone (default: the extension's
    ``gathered_for_output``), for a plan whose lengths are still to be found; ``for_readers``
    likewise, the K and V gathered for their readers beside the layers.
    """
    hints = validated(hints, hints_source)
    if hints.lengths is not None and hints.lengths.inlined:
        planned = planned_index(index, hints, hints_source)
        if planned is not index:  # what was found on the calls' graph is not of this one
            index, shapes, detected, layers = planned, None, None, None
    if hints.lengths is not None and hints.lengths.traced:
        # The plan is of the model whose traced Reshapes read their input's length
        # (traced.py): what was found on this one (its shapes, its layers' nodes) is not.
        index = _untraced(index, hints, hints_source, shapes)
        shapes = detected = None
    if hints.parallelism != "CP":
        raise HintsMismatchError(
            f"{hints_source}: parallelism {hints.parallelism!r}: shard writes context "
            "parallelism (CP) models only"
        )
    _check_tensors(index, hints, hints_source)
    sites: dict[int, FusedSite] = {}
    if any(layer.replace is not None for layer in hints.attention_layers):
        if detected is None:
            detected = detect_attention(index, shapes)
        sites = fused_sites(index, hints, detected, hints_source)
    if layers is None:
        layers = gathered_by_q(
            detected if detected is not None else detect_attention(index, shapes)
        )
    rewriter = _Rewriter(index, hints, hints_source, shapes)

    for position, tensor in enumerate(hints.inputs):
        rewriter.collective(
            tensor.name, REDUCE_SCATTER, tensor.seq_len_idx, tensor.rank, f"inputs[{position}]"
        )
    q_is_gathered = False
    gathered: set[str] = set()
    for position, layer in enumerate(hints.attention_layers):
        if layer.replace is not None:
            # The fused op gathers K and V inside; its output is the rank's queries' only.
            rewriter.fuse(sites[position], layer.replace)
            continue
        if not layers.get(layer.q):
            raise HintsMismatchError(
                f"{hints_source}: attention_layers[{position}]: q {layer.q!r} is not the Q of "
                "any attention layer of the model"
            )
        for k, v in layers[layer.q]:
            for tensor, axis, rank, wanted, what in _layer_gathers(hints, layer, k, v):
                if wanted and tensor not in gathered:
                    gathered.add(tensor)
                    rewriter.collective(
                        tensor,
                        ALL_GATHER,
                        axis,
                        rank,
                        f"attention_layers[{position}] {what}",
                        (f"{what.lower()}_seq_len_idx", "kv_rank"),
                    )
            q_is_gathered |= layer.gather_q or (layer.gather_kv and layer.q in (k, v))
    readers = hints.lengths.for_readers if hints.lengths is not None else ()
    if for_readers is not None:
        readers = for_readers
    _check_readers(index, readers, hints_source)
    for position, gather in enumerate(readers):
        rewriter.collective(
            gather.name,
            ALL_GATHER,
            gather.seq_len_idx,
            None,
            f"gathered_for_readers[{position}]",
            readers=frozenset(gather.nodes),
        )
    if not q_is_gathered:
        for_output = _gathered_for_output(index, hints, hints_source, for_output)
        for position, tensor in enumerate(hints.outputs):
            rewriter.collective(
                tensor.name,
                ALL_GATHER,
                tensor.seq_len_idx,
                tensor.rank,
                f"outputs[{position}]",
                for_output=tensor.name in for_output,
            )
    sharded = ShardedModel(
        model=_build_model(index, rewriter, weights),
        tails=dict(rewriter.tails),
        outputs=dict(zip(index.graph_outputs, rewriter.graph_outputs, strict=True)),
        counted_only=not weights,
    )
    if hints.lengths is None:
        return sharded
    # The extension: the nodes it names get the length they need (lengths.py).
    from shardcheck.sharding.lengths import give_lengths

    shapes = rewriter._shapes if rewriter._shapes is not None else ShapeInference(index)
    if detected is None:
        detected = detect_attention(index, shapes)
    return give_lengths(index, shapes, detected, hints, sharded, hints_source)


def _untraced(
    index: GraphIndex, hints: ShardHints, hints_source: str, shapes: ShapeInference | None
) -> GraphIndex:
    from shardcheck.sharding.traced import untraced_index

    assert hints.lengths is not None
    return untraced_index(index, hints.lengths.traced, hints_source, shapes)


def _gathered_for_output(
    index: GraphIndex, hints: ShardHints, hints_source: str, given: tuple[str, ...] | None
) -> set[str]:
    """The outputs gathered for the graph output only (``given``, else the extension's):
    graph outputs, each."""
    if given is None:
        given = hints.lengths.for_output if hints.lengths is not None else ()
    names = set(given)
    given_out = set(index.graph_outputs)
    missing = sorted(names - given_out)
    if missing:
        raise HintsMismatchError(
            f"{hints_source}: gathered_for_output: tensor {missing[0]!r} is not a graph output "
            f"of the model {index.source}: only a graph output can be gathered for it alone"
        )
    return names


def _layer_gathers(
    hints: ShardHints, layer: AttentionLayerHint, k: str, v: str
) -> Iterable[tuple[str, int, int | None, bool, str]]:
    # Q is gathered on axis 0, without Transposes, as Polygraphy does.
    yield layer.q, 0, None, layer.gather_q, "Q"
    yield k, hints.k_seq_len_idx, hints.kv_rank, layer.gather_kv, "K"
    yield v, hints.v_seq_len_idx, hints.kv_rank, layer.gather_kv, "V"


def _check_readers(index: GraphIndex, readers: tuple[ReaderGather, ...], hints_source: str) -> None:
    """Each tensor gathered for its readers is in the model, and each node named reads it."""
    for position, gather in enumerate(readers):
        where = f"{hints_source}: gathered_for_readers[{position}]"
        if not index.has_tensor(gather.name):
            raise HintsMismatchError(
                f"{where}: tensor {gather.name!r} is not in the model {index.source}"
            )
        reading = {node.name for node in index.consumers_of(gather.name)}
        for node in gather.nodes:
            if node not in reading:
                raise HintsMismatchError(
                    f"{where}: node {node!r} does not read {gather.name!r} in the model "
                    f"{index.source}"
                )


def _check_tensors(index: GraphIndex, hints: ShardHints, hints_source: str) -> None:
    for key, tensors in (("inputs", hints.inputs), ("outputs", hints.outputs)):
        for position, tensor in enumerate(tensors):
            if not index.has_tensor(tensor.name):
                raise HintsMismatchError(
                    f"{hints_source}: {key}[{position}]: tensor {tensor.name!r} is not in the "
                    f"model {index.source}"
                )


def _build_model(index: GraphIndex, rewriter: _Rewriter, weights: bool) -> protos.ModelProto:
    if weights:
        model = without_nodes(index.model, counted_only=False)
        graph = model.graph
    else:
        model = _weightless_copy(index.model)
        graph = model.graph
    graph.node.extend(rewriter.sorted_nodes())
    original_outputs = {info.name: info for info in graph.output}
    del graph.output[:]
    for original, name in zip(index.graph_outputs, rewriter.graph_outputs, strict=True):
        info = protos.ValueInfoProto()
        info.CopyFrom(original_outputs[original])
        info.name = name
        tail = rewriter.tails.get(name)
        if tail is not None and tail.operation != ALL_GATHER:
            # Only a gathered output has the declared (full) shape.
            info.type.tensor_type.ClearField("shape")
        graph.output.append(info)
    moved = [o for o, n in zip(index.graph_outputs, rewriter.graph_outputs, strict=True) if o != n]
    # A graph output that became an inner tensor keeps its declaration, as value_info.
    graph.value_info.extend(original_outputs[name] for name in moved)
    graph.value_info.extend(
        info for info in rewriter.new_value_infos if info.name not in rewriter.graph_outputs
    )
    return model


def without_nodes(model: protos.ModelProto, *, counted_only: bool) -> protos.ModelProto:
    """A copy of ``model`` but its nodes, for a graph of other nodes. One ``counted_only`` is
    copied field by field: its nodes copied only to be deleted would be held twice until the
    copy is freed. One to run or write is copied whole, then its nodes deleted, which keeps
    the fields this onnx does not know (a newer onnx's): a copy by fields leaves them out."""
    if counted_only:
        copy = _fields_but(model, protos.ModelProto(), "graph")
        _fields_but(model.graph, copy.graph, "node")
        return copy
    copy = protos.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.node[:]
    return copy


def _weightless_copy(model: protos.ModelProto) -> protos.ModelProto:
    """``model`` without its nodes, and its initializers without their data but the small
    integer ones that shapes are computed from (names, types and dims kept): a model to count
    the shapes of, at a fraction of a copy's time and memory. Fields this onnx does not know
    are left out too: the model is counted, never written."""
    copy = _fields_but(model, protos.ModelProto(), "graph")
    _fields_but(model.graph, copy.graph, "node", "initializer")
    copy.graph.initializer.extend(map(_hollow, model.graph.initializer))
    return copy


def _fields_but(source: Message, target: Message, *left_out: str) -> Message:
    """``target`` with the fields of ``source`` set, but ``left_out``."""
    for descriptor, value in source.ListFields():
        name = descriptor.name
        if name in left_out:
            continue
        if isinstance(value, Message):
            getattr(target, name).CopyFrom(value)
        elif not isinstance(value, (str, bytes)) and hasattr(value, "extend"):  # repeated
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return target


def _hollow(tensor: protos.TensorProto) -> protos.TensorProto:
    if tensor.data_type in INTEGER_TYPES and math.prod(tensor.dims) <= MAX_VALUE_ELEMENTS:
        return tensor
    hollow = protos.TensorProto(name=tensor.name, data_type=tensor.data_type)
    hollow.dims.extend(tensor.dims)
    return hollow
