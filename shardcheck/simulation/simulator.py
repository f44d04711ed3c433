"""N simulated ranks of a multi-device model, in one process, on the CPU.

The model is cut into stages at its ``DistCollective`` nodes: a node's stage is the number of
collectives on its longest path from the graph inputs, but for the work on weights alone (a
weight's Transpose), done in the stage that reads it, and the ``Constant`` nodes, copied into
each stage that reads them. A stage is one onnxruntime session, built once and run for every
rank, or once for all ranks when all its inputs are the same on every rank (the replicated
graph inputs, an all-gathered tensor). Between stages the collectives run in numpy, with the
meaning of their attributes:

- ``reduce_scatter``: ``reduce_op`` (sum, prod, min, max, avg) across the ranks' copies, then
  the result is split along axis 0 into N equal chunks, chunk r to rank r;
- ``all_gather``: the ranks' tensors concatenated along axis 0, on every rank;
- ``all_reduce``: the sum across ranks, on every rank.

Collectives always span all ranks; other ``groups`` or ``group_size`` are refused. ``root`` and
``nb_rank`` do not change what these three collectives compute.

Stages of one form (stage_forms.py: a transformer's layers) run on one session, made from the
first of them (their leader) with the weights they read as inputs; the runs feed each stage's
own weights: a model of L layers makes a few stage sessions instead of about 3L.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from shardcheck.analysis.elem_types import infer_elem_types
from shardcheck.errors import InputError
from shardcheck.graph.index import attribute_graphs
from shardcheck.runtime.background import InBackground
from shardcheck.runtime.feeds import make_session
from shardcheck.sharding.rewrite import ALL_GATHER, COLLECTIVE_OP, REDUCE_SCATTER, ShardedModel
from shardcheck.simulation.stage_forms import stage_form

ALL_REDUCE = "all_reduce"
REDUCERS = {
    "sum": lambda stacked: stacked.sum(axis=0),
    "prod": lambda stacked: stacked.prod(axis=0),
    "min": lambda stacked: stacked.min(axis=0),
    "max": lambda stacked: stacked.max(axis=0),
    "avg": lambda stacked: stacked.mean(axis=0),
}
# Workers that make stage sessions ahead (onnxruntime makes them without the GIL).
AHEAD_WORKERS = 2
_ORT_NODE_NAME = re.compile(r"Name:'([^']+)'")
_ORT_STATUS = re.compile(r"Status Message: (.*)$")
# onnxruntime prefixes its messages with a source location and a C++ signature.
_ORT_SOURCE_PREFIX = re.compile(r"^\S+\.(?:h|cc|cpp):\d+ (?:[^()]*\([^()]*\) )?")


class RankFailure(Exception):
    """A rank could not compute ``node`` (onnxruntime failed, or a collective cannot split)."""

    def __init__(self, rank: int, node: str | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.node = node
        self.message = message


@dataclass
class _Ahead:
    """A stage's session made ahead of the runs by a worker, for inputs of ``types`` (in the
    order of the stage's inputs); one for all the stages of a form."""

    types: tuple[int, ...]
    state: str = "pending"  # -> "making" (a worker took it) or "skipped" (left to the runs)
    done: threading.Event = field(default_factory=threading.Event)
    session: Any = None


@dataclass
class _Stage:
    level: int
    nodes: list[onnx.NodeProto]
    reads: list[list[str]]  # each node's inputs (``_node_inputs``), in the order of ``nodes``
    inputs: list[str]
    outputs: list[str]  # what later stages, collectives or the graph outputs read
    produced: list[str]  # every tensor the stage makes (the diagnostic outputs)
    sessions: dict[tuple[frozenset[str], bool], Any] = field(default_factory=dict)
    ahead: _Ahead | None = None
    # Of a stage that shares its leader's session (``ahead``): the weights fed as inputs.
    leader: _Stage | None = None
    lifted: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Collective:
    node: onnx.NodeProto
    operation: str
    reduce_op: str


class RankValues:
    """The tensors of every rank; a replicated tensor is one array shared by all ranks."""

    def __init__(self, ranks: int, feeds: Mapping[str, np.ndarray]) -> None:
        self.per_rank: list[dict[str, np.ndarray]] = [dict(feeds) for _ in range(ranks)]
        self.replicated: set[str] = set(feeds)
        self.failure: RankFailure | None = None

    def feeds_for(self, stage: _Stage, rank: int) -> dict[str, np.ndarray]:
        return {name: self.per_rank[rank][name] for name in stage.inputs}

    def set_replicated(self, result: Mapping[str, np.ndarray]) -> None:
        for values in self.per_rank:
            values.update(result)
        self.replicated.update(result)

    def set_rank(self, rank: int, result: Mapping[str, np.ndarray]) -> None:
        self.per_rank[rank].update(result)
        self.replicated.difference_update(result)


class RankSimulator:
    """Runs a sharded model on ``ranks`` simulated ranks; sessions are built once per stage.

    ``weights`` is the single-device model: stages take their initializers, opsets and
    functions from it; ``weights_dir`` is where its external weight files are (see
    ``feeds.make_session``).
    """

    def __init__(
        self,
        sharded: ShardedModel,
        weights: onnx.ModelProto,
        ranks: int,
        weights_dir: Path | None = None,
    ) -> None:
        self.sharded = sharded
        self.ranks = ranks
        self.weights_dir = weights_dir
        self.template = weights
        self.weights = {tensor.name: tensor for tensor in weights.graph.initializer}
        graph = sharded.model.graph
        self.nodes, self.reads = _toposorted(graph)
        self.producers = {name: node for node in self.nodes for name in node.output}
        # DistCollective node -> the tensor that ends its chain (after the Transpose back).
        self.tail_of_collective = {
            tail.collective_node: name for name, tail in sharded.tails.items()
        }
        self.steps = self._plan({i.name for i in graph.input}, [o.name for o in graph.output])
        self._check_groups()
        self.session_runs = 0
        self._ahead_lock = threading.Lock()
        self._lifted_values: dict[str, np.ndarray] = {}
        self._make_sessions_ahead(graph)

    @property
    def stage_count(self) -> int:
        return sum(1 for step in self.steps if isinstance(step, _Stage))

    def made_by(self, tensor: str) -> tuple[str, str]:
        """The node that made ``tensor`` (for a gathered or scattered tensor: its collective)."""
        tail = self.sharded.tails.get(tensor)
        if tail is not None:
            return tail.collective_node, COLLECTIVE_OP
        node = self.producers.get(tensor)
        return (node.name, node.op_type) if node is not None else ("<graph input>", "")

    # ----------------------------------------------------------------- planning

    def _plan(self, graph_inputs: set[str], graph_outputs: list[str]) -> list[_Stage | _Collective]:
        collective = [_is_collective(node) for node in self.nodes]
        level = dict.fromkeys(set(self.weights) | graph_inputs, 0)
        level_of = level.get
        node_levels: list[int] = []
        for node, reads, gathers in zip(self.nodes, self.reads, collective, strict=True):
            at = 0
            for name in reads:
                here = level_of(name, 0)
                if here > at:
                    at = here
            node_levels.append(at)
            for name in node.output:
                level[name] = at + 1 if gathers else at
        read_at: dict[str, float] = dict.fromkeys(graph_outputs, float("inf"))
        # What stays where it is made: the graph's outputs and what the collectives read.
        kept = set(graph_outputs).union(
            *(reads for reads, gathers in zip(self.reads, collective, strict=True) if gathers)
        )
        copied = self._copied_constants(kept)
        placed_in_readers = set(copied.values())
        self._defer_weight_work(node_levels, collective, kept, copied, placed_in_readers)
        # The nodes of each level, in order (one pass: a model has hundreds of levels).
        by_level: list[list[int]] = [[] for _ in range(max(node_levels, default=0) + 1)]
        for position, at in enumerate(node_levels):
            if position in placed_in_readers:
                continue
            by_level[at].append(position)
            # A collective reads its input after the stage of its level has run.
            reader = at + 0.5 if collective[position] else at
            for name in self.reads[position]:
                if read_at.get(name, -1.0) < reader:
                    read_at[name] = reader

        steps: list[_Stage | _Collective] = []
        for at, here in enumerate(by_level):
            members = [i for i in here if not collective[i]]
            if members:
                steps.append(self._stage(at, members, read_at, copied))
            steps.extend(_collective(self.nodes[i]) for i in here if collective[i])
        return steps

    def _defer_weight_work(
        self,
        node_levels: list[int],
        collective: list[bool],
        kept: set[str],
        copied: dict[str, int],
        copies: set[int],
    ) -> None:
        """Move the nodes computed from weights and constants alone (a weight's Transpose)
        to the stage of their first reader: the first stage would otherwise compute every
        layer's and hand them all on, holding a copy of the weights for the whole run (and
        the layers' stages, computing their own, are of one form). Not those whose outputs
        are ``kept``. ``copies``: the positions of the ``copied`` constants. ``node_levels`` is
        changed in place."""
        static = set(self.weights).union(copied, [""])  # "": an optional input left out
        movable: list[int] = []  # in order
        for position, reads in enumerate(self.reads):
            if not collective[position] and static.issuperset(reads):
                static.update(self.nodes[position].output)
                if position not in copies:
                    movable.append(position)
        first_read: dict[str, int] = {}  # static tensor -> the lowest level of a stage reading it
        for position in range(len(self.nodes) - 1, -1, -1):
            if collective[position]:
                continue
            at = node_levels[position]
            if movable and movable[-1] == position:
                movable.pop()
                outputs = [name for name in self.nodes[position].output if name]
                if kept.isdisjoint(outputs):
                    later = min(
                        (first_read[name] for name in outputs if name in first_read), default=at
                    )
                    node_levels[position] = at = max(at, later)
            for name in self.reads[position]:
                if name in static and first_read.get(name, at + 1) > at:
                    first_read[name] = at

    def _copied_constants(self, kept: set[str]) -> dict[str, int]:
        """Constant nodes copied into each stage that reads them, by output: the first stage
        would otherwise compute every layer's constants and hand them on, and the layers'
        stages, holding their own, are of one form (stage_forms.py). Not those whose output
        is ``kept``."""
        return {
            node.output[0]: position
            for position, node in enumerate(self.nodes)
            if _is_constant(node)
            and len(node.output) == 1
            and node.output[0]
            and node.output[0] not in kept
        }

    def _stage(
        self, at: int, members: list[int], read_at: dict[str, float], copied: dict[str, int]
    ) -> _Stage:
        constants = {
            copied[name]: None for i in members for name in self.reads[i] if name in copied
        }
        order = [*constants, *members]  # constants read no tensor: first is in order
        nodes = [self.nodes[i] for i in order]
        reads = [self.reads[i] for i in order]
        produced = [name for node in nodes for name in node.output if name]
        made = set(produced)
        inputs: dict[str, None] = {}
        for names in reads:
            for name in names:
                if name and name not in made and name not in self.weights:
                    inputs.setdefault(name)
        outputs = [name for name in produced if read_at.get(name, -1.0) > at and name not in copied]
        return _Stage(at, nodes, reads, list(inputs), outputs, produced)

    def _check_groups(self) -> None:
        for step in self.steps:
            if not isinstance(step, _Collective):
                continue
            attributes = _attributes(step.node)
            groups = list(attributes.get("groups", []))
            group_size = int(attributes.get("group_size", 0))
            if (groups and groups != list(range(self.ranks))) or group_size not in (0, self.ranks):
                raise InputError(
                    f"node {step.node.name!r}: groups {groups}, group_size {group_size}: the "
                    f"simulator runs collectives over all {self.ranks} ranks only"
                )

    def _make_sessions_ahead(self, graph: onnx.GraphProto) -> None:
        """Make the stages' sessions in background workers, side by side, before the runs
        ask for them: the input types of a stage are inferred (dtypes.py) instead of read
        from the values of the stages before it. A stage with an input of unknown type is
        left to the runs, which make its session when they reach it, as they do when the
        values they have are not of the types a session was made for."""
        known = {name: tensor.data_type for name, tensor in self.weights.items()}
        known.update(
            (i.name, i.type.tensor_type.elem_type)
            for i in graph.input
            if i.type.tensor_type.elem_type
        )
        types = infer_elem_types(self.nodes, known, same_as_input=COLLECTIVE_OP)
        typed = [
            step
            for step in self.steps
            if isinstance(step, _Stage) and all(name in types for name in step.inputs)
        ]
        for stage in typed:
            stage.ahead = _Ahead(tuple(types[name] for name in stage.inputs))
        self._share_sessions(typed)
        queue = [stage for stage in typed if stage.leader in (None, stage)]
        pending = iter(queue)
        for worker in range(min(AHEAD_WORKERS, len(queue))):
            InBackground(f"shardcheck-stages-{worker}", self._make_ahead, pending)

    def _share_sessions(self, stages: list[_Stage]) -> None:
        """Stages of one form (two or more) share the ahead session of the first, which is
        made with their weights as inputs. Only stages with the same op types are compared."""
        by_ops: dict[tuple[str, ...], list[_Stage]] = {}
        for stage in stages:
            by_ops.setdefault(tuple(node.op_type for node in stage.nodes), []).append(stage)
        for same_ops in by_ops.values():
            if len(same_ops) < 2:
                continue
            by_form: dict[Any, list[tuple[_Stage, tuple[str, ...]]]] = {}
            for stage in same_ops:
                assert stage.ahead is not None
                form = stage_form(
                    stage.nodes,
                    stage.reads,
                    stage.inputs,
                    stage.ahead.types,
                    stage.outputs,
                    self.weights,
                )
                if form is not None:
                    by_form.setdefault(form.key, []).append((stage, form.lifted))
            for members in by_form.values():
                if len(members) < 2:
                    continue
                leader = members[0][0]
                for stage, lifted in members:
                    stage.leader, stage.lifted, stage.ahead = leader, lifted, leader.ahead

    def _make_ahead(self, pending: Iterator[_Stage]) -> None:
        """One worker: the sessions of the stages no one has taken yet, in order."""
        while (stage := self._claim(pending)) is not None:
            assert stage.ahead is not None
            self._make_claimed(stage, stage.ahead)

    def _make_claimed(self, stage: _Stage, ahead: _Ahead) -> None:
        """The session ``ahead`` of ``stage``, claimed ("making"): a leader's has the weights
        it lifts as inputs."""
        try:
            declared = {
                name: (elem, None) for name, elem in zip(stage.inputs, ahead.types, strict=True)
            }
            model = self._stage_model(
                stage, frozenset(), declared, stage.outputs, lifted=stage.lifted
            )
            ahead.session = make_session(model, self.weights_dir)
        except Exception:  # the runs make this stage's session again, and report its error
            ahead.session = None
        finally:
            ahead.done.set()

    def _claim(self, pending: Iterator[_Stage]) -> _Stage | None:
        with self._ahead_lock:
            for stage in pending:
                if stage.ahead is not None and stage.ahead.state == "pending":
                    stage.ahead.state = "making"
                    return stage
        return None

    def stop_making_ahead(self) -> None:
        """The workers take no more stages (a run has ended, or none will come), and the
        sessions they are making are waited for: no onnxruntime work is left running in the
        background (a process that ends under it crashes). The stages not taken are left to
        the runs that may still come."""
        with self._ahead_lock:
            aheads = [step.ahead for step in self.steps if isinstance(step, _Stage) and step.ahead]
            for ahead in aheads:
                if ahead.state == "pending":
                    ahead.state = "skipped"
        for ahead in aheads:
            if ahead.state == "making":
                ahead.done.wait()

    def _ahead_session(self, stage: _Stage, feeds: Mapping[str, np.ndarray]) -> Any:
        """The stage's session made ahead, if one was and ``feeds`` have the types it was
        made for; else None (a stage no worker has taken yet is left to the caller, but for
        the session of a form, made here: the form's other stages run on it too)."""
        ahead = stage.ahead
        if ahead is None:
            return None
        with self._ahead_lock:
            shared_here = stage.leader is not None and ahead.state != "making"
            if shared_here:
                ahead.state = "making"
            elif ahead.state != "making":  # no worker has it, nor will: the caller makes it
                ahead.state = "skipped"
                return None
        if shared_here:
            assert stage.leader is not None
            self._make_claimed(stage.leader, ahead)
        ahead.done.wait()
        if any(
            _elem_type(feeds[name]) != elem
            for name, elem in zip(stage.inputs, ahead.types, strict=True)
        ):
            return None
        return ahead.session

    def _run_on_leader(self, stage: _Stage, feeds: Mapping[str, np.ndarray]) -> list[Any] | None:
        """The stage's outputs from the session it shares with its form, or None when that
        session is not there or fails (the stage's own session then runs it, and names its
        own nodes in any error)."""
        leader = stage.leader
        assert leader is not None
        session = self._ahead_session(stage, feeds)
        if session is not None:
            shared = {to: feeds[name] for name, to in zip(stage.inputs, leader.inputs, strict=True)}
            try:
                for name, to in zip(stage.lifted, leader.lifted, strict=True):
                    shared[to] = self._lifted_value(name)
                return session.run(leader.outputs, shared)
            except (*ort_errors(), OSError, ValueError):
                pass
        # On its own from now on; a leader's names still serve the other stages of its form.
        stage.leader, stage.ahead = None, None
        return None

    def _lifted_value(self, name: str) -> np.ndarray:
        value = self._lifted_values.get(name)
        if value is None:
            tensor = self.weights[name]
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                value = _mapped(tensor, self.weights_dir)
            else:
                value = numpy_helper.to_array(tensor)
            self._lifted_values[name] = value
        return value

    # ----------------------------------------------------------------- running

    def run(self, feeds: Mapping[str, np.ndarray], *, diagnostic: bool = False) -> RankValues:
        """Every rank's tensors. Normally only what later steps read is kept and a failure is
        raised; in diagnostic mode every tensor is kept, and the first failure is recorded in
        the result with what could still be computed."""
        values = RankValues(self.ranks, feeds)
        for step in self.steps:
            try:
                if isinstance(step, _Collective):
                    self._run_collective(step, values)
                else:
                    self._run_stage(step, values, diagnostic)
            except RankFailure as failure:
                if not diagnostic:
                    raise
                values.failure = failure
                break
        return values

    def _run_stage(self, stage: _Stage, values: RankValues, diagnostic: bool) -> None:
        if all(name in values.replicated for name in stage.inputs):
            result, failure = self._run_on_rank(stage, values.feeds_for(stage, 0), 0, diagnostic)
            values.set_replicated(result)
        else:
            failure = None
            for rank in range(self.ranks):
                feeds = values.feeds_for(stage, rank)
                result, rank_failure = self._run_on_rank(stage, feeds, rank, diagnostic)
                values.set_rank(rank, result)
                failure = failure or rank_failure
        if failure is not None:
            raise failure

    def _run_on_rank(
        self, stage: _Stage, feeds: dict[str, np.ndarray], rank: int, diagnostic: bool
    ) -> tuple[dict[str, np.ndarray], RankFailure | None]:
        """Run a stage for one rank. In diagnostic mode a failing node and everything that
        depends on it are cut off and the rest runs again."""
        if not diagnostic:
            return self._session_run(stage, frozenset(), False, feeds, rank), None
        removed: frozenset[str] = frozenset()
        first: RankFailure | None = None
        while True:
            try:
                return self._session_run(stage, removed, True, feeds, rank), first
            except RankFailure as failure:
                first = first or failure
                if failure.node is None or failure.node in removed:
                    return {}, first
                removed = removed | _downstream(stage.nodes, failure.node)

    def _session_run(
        self,
        stage: _Stage,
        removed: frozenset[str],
        diagnostic: bool,
        feeds: dict[str, np.ndarray],
        rank: int,
    ) -> dict[str, np.ndarray]:
        wanted = stage.produced if diagnostic else stage.outputs
        cut = {name for node in stage.nodes if node.name in removed for name in node.output}
        outputs = [name for name in wanted if name not in cut]
        try:
            if stage.leader is not None and not removed and not diagnostic:
                shared = self._run_on_leader(stage, feeds)
                if shared is not None:
                    self.session_runs += 1
                    return dict(zip(outputs, shared, strict=True))
            session = stage.sessions.get((removed, diagnostic))
            if session is None and not removed and not diagnostic:
                session = self._ahead_session(stage, feeds)
            if session is None:
                declared = {name: (_elem_type(value), value.ndim) for name, value in feeds.items()}
                model = self._stage_model(stage, removed, declared, outputs)
                session = make_session(model, self.weights_dir)
            stage.sessions[(removed, diagnostic)] = session
            self.session_runs += 1
            values = session.run(outputs, feeds)
        except ort_errors() as error:
            message = " ".join(str(error).split())
            node = _ORT_NODE_NAME.search(message)
            raise RankFailure(
                rank, node.group(1) if node else None, f"onnxruntime: {_short(message)}"
            ) from None
        return dict(zip(outputs, values, strict=True))

    def _stage_model(
        self,
        stage: _Stage,
        removed: frozenset[str],
        declared: Mapping[str, tuple[int, int | None]],
        outputs: list[str],
        lifted: tuple[str, ...] = (),
    ) -> onnx.ModelProto:
        """The stage as a model; ``declared``: each input's element type and rank (None:
        any rank); ``lifted``: weights that are inputs instead of initializers."""
        kept = [i for i, node in enumerate(stage.nodes) if node.name not in removed]
        nodes = [stage.nodes[i] for i in kept]
        used = {name for i in kept for name in stage.reads[i]}
        inputs = []
        for name in stage.inputs:
            elem, ndim = declared[name]
            shape = None if ndim is None else [None] * ndim
            inputs.append(helper.make_tensor_value_info(name, elem, shape))
        for name in lifted:
            weight = self.weights[name]
            inputs.append(helper.make_tensor_value_info(name, weight.data_type, weight.dims))
        graph = helper.make_graph(
            nodes,
            f"stage_{stage.level}",
            inputs,
            [untyped_output(name) for name in outputs],
            [self.weights[name] for name in sorted(used.intersection(self.weights) - set(lifted))],
        )
        model = helper.make_model(
            graph,
            opset_imports=list(self.template.opset_import),
            ir_version=self.template.ir_version,
        )
        model.functions.extend(self.template.functions)
        return model

    def _run_collective(self, step: _Collective, values: RankValues) -> None:
        source, target = step.node.input[0], step.node.output[0]
        if source in self.weights and source not in values.replicated:
            # A weight cut by the hints (a position table added whole): every rank holds it.
            base_dir = str(self.weights_dir) if self.weights_dir is not None else ""
            values.set_replicated({source: numpy_helper.to_array(self.weights[source], base_dir)})
        if not all(source in rank_values for rank_values in values.per_rank):
            raise RankFailure(0, step.node.name, f"no value of {source!r} on every rank")
        pieces = [rank_values[source] for rank_values in values.per_rank]
        if pieces[0].ndim == 0:
            raise RankFailure(0, step.node.name, f"{step.operation} of a scalar (no axis 0)")
        if len({piece.shape for piece in pieces}) > 1:
            raise RankFailure(
                0,
                step.node.name,
                f"{step.operation} of tensors whose shapes differ between ranks "
                f"({', '.join(str(list(piece.shape)) for piece in pieces)})",
            )
        if step.operation == ALL_GATHER:
            values.set_replicated({target: np.concatenate(pieces, axis=0)})
        elif step.operation == ALL_REDUCE:
            values.set_replicated({target: np.stack(pieces).sum(axis=0).astype(pieces[0].dtype)})
        else:
            reduced = REDUCERS[step.reduce_op](np.stack(pieces)).astype(pieces[0].dtype)
            if reduced.shape[0] % self.ranks:
                tail = self.tail_of_collective.get(step.node.name)
                axis = self.sharded.tails[tail].axis if tail is not None else 0
                raise RankFailure(
                    0,
                    step.node.name,
                    f"the reduce-scatter axis ({axis}) has length {reduced.shape[0]}, which is "
                    f"not a multiple of the {self.ranks} ranks",
                )
            for rank, chunk in enumerate(np.split(reduced, self.ranks, axis=0)):
                values.set_rank(rank, {target: chunk})


# --------------------------------------------------------------------------- graph helpers


def _mapped(tensor: onnx.TensorProto, weights_dir: Path | None) -> np.ndarray:
    """An external weight, mapped from its file (ValueError or OSError when it cannot be)."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    shape = tuple(tensor.dims)
    nbytes = math.prod(shape) * dtype.itemsize
    if weights_dir is None or int(entries.get("length") or nbytes) != nbytes:
        raise ValueError(f"tensor {tensor.name!r}: its external data cannot be mapped")
    if nbytes == 0:
        return np.zeros(shape, dtype)
    offset = int(entries.get("offset") or 0)
    return np.memmap(weights_dir / entries["location"], dtype, "r", offset, shape)


def _is_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx")


def _is_collective(node: onnx.NodeProto) -> bool:
    return node.op_type == COLLECTIVE_OP and node.domain in ("", "ai.onnx")


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def _collective(node: onnx.NodeProto) -> _Collective:
    attributes = _attributes(node)
    operation = str(attributes.get("collective_operation", ""))
    reduce_op = str(attributes.get("reduce_op", "none"))
    where = f"node {node.name!r}"
    if operation not in (REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE):
        raise InputError(f"{where}: collective_operation {operation!r} cannot be simulated")
    if operation == REDUCE_SCATTER and reduce_op not in REDUCERS:
        raise InputError(f"{where}: reduce_op {reduce_op!r} cannot be simulated")
    if len(node.input) != 1 or len(node.output) != 1:
        raise InputError(f"{where}: a DistCollective has one input and one output")
    return _Collective(node, operation, reduce_op)


def _elem_type(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(value.dtype)


def _node_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of a node, with the outer tensors its subgraphs (If, Loop, Scan) read."""
    names = node.input[:]
    for attribute in node.attribute:
        for graph in attribute_graphs(attribute):
            local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
            for inner in graph.node:
                names.extend(n for n in _node_inputs(inner) if n and n not in local)
                local.update(inner.output)
    return names


def _toposorted(graph: onnx.GraphProto) -> tuple[list[onnx.NodeProto], list[list[str]]]:
    """The nodes in a topological order (the graph's own where it is one), and what each
    reads (``_node_inputs``). An unnamed node is replaced by a named copy, so that
    onnxruntime's errors can point at it."""
    nodes: list[onnx.NodeProto] = []
    for position, proto in enumerate(graph.node):
        if not proto.name:
            named = onnx.NodeProto()
            named.CopyFrom(proto)
            named.name = f"<unnamed {proto.op_type} #{position}>"
            proto = named
        nodes.append(proto)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    reads = [_node_inputs(node) for node in nodes]
    if all(
        producer.get(name, -1) < position for position, names in enumerate(reads) for name in names
    ):
        return nodes, reads
    order: list[int] = []
    placed: set[int] = set()
    visiting: set[int] = set()
    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            position, inputs_placed = stack.pop()
            if inputs_placed:
                placed.add(position)
                order.append(position)
                continue
            if position in placed or position in visiting:
                continue
            visiting.add(position)
            stack.append((position, True))
            for name in reversed(reads[position]):
                before = producer.get(name)
                if before is not None and before not in placed:
                    stack.append((before, False))
    return [nodes[i] for i in order], [reads[i] for i in order]


def _downstream(nodes: list[onnx.NodeProto], start: str) -> frozenset[str]:
    """The names of ``start`` and of every node of ``nodes`` that depends on it."""
    removed = {start}
    tainted: set[str] = set()
    for node in nodes:
        if node.name in removed or any(name in tainted for name in _node_inputs(node)):
            removed.add(node.name)
            tainted.update(node.output)
    return frozenset(removed)


def untyped_output(name: str) -> onnx.ValueInfoProto:
    """A graph output without type; onnxruntime infers it."""
    info = onnx.ValueInfoProto()
    info.name = name
    return info


def ort_errors() -> tuple[type[BaseException], ...]:
    """The exception types onnxruntime raises for a model it cannot load or run."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "RuntimeException", "InvalidGraph", "NotImplemented")
    return tuple(getattr(state, name) for name in names if hasattr(state, name))


def _short(message: str) -> str:
    status = _ORT_STATUS.search(message)
    text = status.group(1) if status else message
    return _ORT_SOURCE_PREFIX.sub("", text)
