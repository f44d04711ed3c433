"""verify's onnxruntime checks: runs at several lengths, and what their shapes say.

The model runs once per sequence length with every hinted tensor, each layer's Q and gathered
K and V and its masks exposed as outputs; the axis that changes with the length is the sequence
axis, whatever the dims are called.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from shardcheck.analysis.axes import AxisMapper
from shardcheck.analysis.detect import AttentionLayer, sequence_dim
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import InputError
from shardcheck.graph.index import SHAPE_OPS, GraphIndex
from shardcheck.graph.loader import check_weight_files, weights_dir
from shardcheck.hints.model import ShardHints, ShardTensor
from shardcheck.runtime.background import InBackground
from shardcheck.runtime.feeds import make_feeds, make_session
from shardcheck.runtime.memory import check_memory
from shardcheck.verification.findings import ERROR, INFO, WARNING, Report
from shardcheck.wording import listed

_ORT_NODE = re.compile(r"Name:'([^']*)'")
Progress = Callable[[str], None]
DimChooser = Callable[[int], dict[str, int]]


@dataclass(frozen=True)
class BakedLength:
    """The model ran at ``ran_at`` only, and failed at ``failed_at`` (at ``node``)."""

    ran_at: tuple[int, ...]
    failed_at: int
    node: str
    message: str  # onnxruntime's, shortened


class RuntimeCheck:
    """onnxruntime runs at several lengths, and what their shapes say about the hints."""

    def __init__(
        self,
        index: GraphIndex,
        hints: ShardHints,
        by_q: dict[str, AttentionLayer],
        report: Report,
        seed: int,
        timeout: float | None,
        progress: Progress | None,
        *,
        shapes: ShapeInference | None = None,
    ) -> None:
        self.index = index
        self.shapes = shapes
        self.hints = hints
        self.by_q = by_q
        self.report = report
        self.seed = seed
        self.timeout = timeout
        self.progress = progress
        self.ran = False
        self.mask_values: dict[str, np.ndarray] = {}
        # Per length: the dims of the run and its graph outputs (the CP simulation's reference).
        self.graph_outputs: dict[int, tuple[dict[str, int], dict[str, np.ndarray]]] = {}
        self.baked: BakedLength | None = None
        self._walks: _Walks | None = None
        # For the few tensors whose axis is followed to the masks (asked in prepare and run).
        self._mapper: AxisMapper | None = None

    def prepare(self, pending: PendingSession, seq_lens: list[int], choose: DimChooser) -> None:
        """What needs no run, done while the session is made: every length fits in memory,
        or nothing runs (InputError), and the graph walks of the comparison."""
        # Only the sequence dim differs between the runs and no tensor shrinks as it grows:
        # the longest run is the one to check.
        longest = max(seq_lens)
        check_memory(
            self.index,
            choose(longest),
            seq_len=longest,
            shapes=self.shapes,
            layers=self.by_q.values(),
            kept=pending.watched,
        )
        self._walks = self._graph_walks()

    def run(self, pending: PendingSession, seq_lens: list[int], choose: DimChooser) -> None:
        """The runs, once ``prepare`` has been made."""
        walks = self._walks
        assert walks is not None, "RuntimeCheck.prepare comes first"
        session = pending.session(self.progress)
        shapes_by_len: dict[int, dict[str, tuple[int, ...]]] = {}
        failures: dict[int, tuple[str, dict[str, int]]] = {}
        for length in seq_lens:
            dims = choose(length)
            feeds = make_feeds(self.index, dims, self.seed)
            failure = _run(session, feeds, self.timeout, self.progress, length)
            # No timings: the JSON report is diffed between runs, and must be the same.
            self.report.runs.append({"seq_len": length, "dims": dims, "ok": failure is None})
            if failure is not None:
                failures[length] = (failure, dims)
                continue
            outputs, values = session.last
            declared = set(self.index.graph_outputs)
            self.graph_outputs[length] = (
                dims,
                {n: v for n, v in zip(outputs, values, strict=True) if n in declared},
            )
            if not shapes_by_len:
                masks = {m for layer in self.by_q.values() for m in layer.masks}
                self.mask_values = {
                    n: v for n, v in zip(outputs, values, strict=True) if n in masks
                }
            shapes_by_len[length] = {
                **{name: tuple(v.shape) for name, v in feeds.items()},
                **{name: tuple(v.shape) for name, v in zip(outputs, values, strict=True)},
            }
        if failures:
            length, (message, dims) = next(iter(failures.items()))
            ran_at = sorted(shapes_by_len)
            if ran_at and length > ran_at[-1]:
                self._refuse_past_longest(session, choose, length, ran_at, message)
            self._failed(length, message, ran_at, dims)
            return
        self.ran = True
        self._compare(shapes_by_len, seq_lens, walks)

    def _refuse_past_longest(
        self,
        session: _Session,
        choose: DimChooser,
        length: int,
        ran_at: list[int],
        message: str,
    ) -> None:
        """The model ran at shorter lengths, not at ``length``: either the length is baked
        into it (then it fails at any other length, shorter ones too), or ``length`` is past
        the longest it supports (a position table's size). One run at a shorter length tells
        which; the latter is refused (InputError) as a --seq-lens too long."""
        shorter = ran_at[0] // 2
        if shorter < 1:
            return
        dims = choose(shorter)
        if _run(session, make_feeds(self.index, dims, self.seed), self.timeout, None, shorter):
            return
        match = _ORT_NODE.search(message)
        node = f" (at node {match.group(1)})" if match else ""
        raise InputError(
            f"{self.index.source}: the model runs at sequence lengths "
            f"{listed([str(n) for n in (shorter, *ran_at)])} but not at {length}{node}: "
            f"{length} is past the longest it supports (the size of a position table, say); "
            f"choose shorter --seq-lens. onnxruntime: {_short(message)}"
        )

    def _found(self, code: str, field: str) -> bool:
        return any(f.code == code and f.field == field for f in self.report.findings)

    def _failed(self, length: int, message: str, ran_at: list[int], dims: dict[str, int]) -> None:
        match = _ORT_NODE.search(message)
        node = match.group(1) if match else "unknown node"
        if ran_at:
            # Reported by report_baked, once verify knows whether CP was simulated there.
            self.baked = BakedLength(tuple(ran_at), length, node, _short(message))
            return
        chosen = ", ".join(f"{k}={v}" for k, v in dims.items())
        self.report.add(
            "SC001",
            ERROR,
            "model",
            f"the model does not run in onnxruntime with {chosen} (node {node}); if it "
            "needs other sizes (an audio encoder's convolutions need hundreds of samples), "
            f"give them with --seq-lens and --dim. onnxruntime: {_short(message)}",
            tensor=node,
            expected="runs",
            observed="fails",
        )

    def report_baked(self, simulated: bool | None, ranks: int | None) -> None:
        """SC002 for a model that runs only at the lengths it was traced with, if it is one.

        The sequence axes cannot be compared across lengths then. Each rank runs a shorter
        slice, which fails at a node that holds the traced length, unless the hints leave that
        node computed whole before the cuts (TorchScript's nn.MultiheadAttention, whose K and
        V reshapes hold it, shards with cuts on Q, K and V): only the CP simulation at the
        traced length tells. ``simulated``: whether it matched there (None: not run)."""
        baked = self.baked
        if baked is None:
            return
        ran = listed([str(n) for n in baked.ran_at])
        what = (
            f"the model runs at sequence length {ran} but not at {baked.failed_at}: the length "
            f"is baked into it (at node {baked.node}), so the sequence axes cannot be checked "
            "at other lengths"
        )
        if simulated and not self.hints.inputs:
            level = ERROR
            verdict = (
                f"the CP simulation on {ranks} ranks matched at {ran}, but these hints scatter "
                "nothing, so every rank computed the whole model: add the tensors to scatter "
                "to inputs"
            )
        elif simulated:
            level = WARNING
            verdict = (
                f"the CP simulation on {ranks} ranks matched at {ran}: these hints shard it at "
                "that length only"
            )
        elif simulated is None:
            level = ERROR
            verdict = (
                "CP can shard it at that length only if no rank's slice reaches a node that "
                "holds it: simulate CP there with --ranks, or export the model with a dynamic "
                "sequence axis"
            )
        else:
            level = ERROR
            verdict = (
                f"the CP simulation on {ranks} ranks at {ran} did not pass: export the model "
                "with a dynamic sequence axis, or cut after the nodes that hold the length"
            )
        self.report.add(
            "SC002",
            level,
            "model",
            f"{what}; {verdict}. onnxruntime: {baked.message}",
            tensor=baked.node,
            expected="runs at any length",
            observed=f"fails at {baked.failed_at}",
        )

    def _compare(
        self,
        shapes: dict[int, dict[str, tuple[int, ...]]],
        seq_lens: list[int],
        walks: _Walks,
    ) -> None:
        first, second = shapes[seq_lens[0]], shapes[seq_lens[1]]
        if all(first[name] == second[name] for name in self.index.graph_inputs):
            self.report.add(
                "SC120",
                INFO,
                "model",
                "no input of the model changes with the sequence length (it is fixed by the "
                "inputs, e.g. image patches); the axis checks by running were skipped",
            )
            return

        def changing(name: str) -> list[int] | None:
            a, b = first.get(name), second.get(name)
            if a is None or b is None:
                return None
            if len(a) != len(b):
                return None
            return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]

        for kind, tensors in (("inputs", self.hints.inputs), ("outputs", self.hints.outputs)):
            for tensor in tensors:
                axes = changing(tensor.name)
                if axes is None:
                    continue
                hint_field = f"{kind}[name={tensor.name}]"
                rank = len(first[tensor.name])
                if (
                    tensor.rank is not None
                    and tensor.rank != rank
                    and not self._found("SC104", f"{hint_field}.rank")
                ):
                    self.report.add(
                        "SC104",
                        ERROR,
                        f"{hint_field}.rank",
                        f"rank {tensor.rank} given for {tensor.name!r}; it has rank {rank}",
                        tensor=tensor.name,
                        expected=rank,
                        observed=tensor.rank,
                    )
                if not axes:
                    self.report.add(
                        "SC117",
                        ERROR,
                        f"{hint_field}.seq_len_idx",
                        f"{tensor.name!r} does not change with the sequence length: it has no "
                        "sequence axis to split",
                        tensor=tensor.name,
                        expected="a sequence axis",
                        observed="none",
                    )
                elif tensor.seq_len_idx not in axes:
                    self.report.add(
                        "SC101",
                        ERROR,
                        f"{hint_field}.seq_len_idx",
                        f"{tensor.name!r} carries the sequence on axis {axes[0]} (shape "
                        f"{first[tensor.name]} at length {seq_lens[0]}, {second[tensor.name]} at "
                        f"{seq_lens[1]}), not on axis {tensor.seq_len_idx}",
                        tensor=tensor.name,
                        expected=axes[0],
                        observed=tensor.seq_len_idx,
                    )
        self._compare_layers(changing, first)
        self._unhinted_inputs(changing, first, walks)
        self._key_only_inputs(first, walks)

    def _compare_layers(self, changing: Callable[[str], list[int] | None], first: dict) -> None:
        for hint in self.hints.attention_layers:
            layer = self.by_q.get(hint.q)
            if layer is None:
                continue
            for code, hint_field, tensor, hinted in (
                ("SC105", "k_seq_len_idx", layer.gathered_k, self.hints.k_seq_len_idx),
                ("SC106", "v_seq_len_idx", layer.gathered_v, self.hints.v_seq_len_idx),
            ):
                axes = changing(tensor)
                if axes and axes != [hinted] and not self._found(code, hint_field):
                    self.report.add(
                        code,
                        ERROR,
                        hint_field,
                        f"layer {layer.name}: the gathered tensor {tensor} changes with the "
                        f"sequence on axis {axes} (observed), the hints gather axis {hinted}",
                        tensor=tensor,
                        expected=axes[0],
                        observed=hinted,
                    )
            axes = changing(layer.q)
            query = len(first.get(layer.q, ())) - 2 if layer.q_axis is None else layer.q_axis
            if axes is not None and axes != [query]:
                self.report.add(
                    "SC118",
                    WARNING,
                    f"attention_layers[q={hint.q}]",
                    f"layer {layer.name}: Q {layer.q} changes on axes {axes}, expected its "
                    f"query axis {query}",
                    tensor=layer.q,
                    expected=query,
                    observed=axes,
                )

    def _graph_walks(self) -> _Walks:
        query, key, masks = _attention_sides(self.index, self.by_q, self.hints)
        ends = query | key | masks
        hinted = {t.name for t in self.hints.inputs}
        # A fused attention node is reached through its Q, K and V, never past it from a mask
        # over the keys it reads: that mask does not make the next layer's Q.
        fused = {layer.output for layer in self.by_q.values() if layer.kind == "fused"}
        walks = _Walks(query, key, masks)
        for name in self.index.graph_inputs:
            if name not in hinted:
                # Through data only, up to the attention inputs.
                walks.input_reach[name] = self.index.computed_from(
                    [name], stop=hinted | fused, ends=ends, through_shapes=False
                )
        # Nearly every hinted tensor feeds Q, K or V: find those in one walk back, and follow
        # only the others forward.
        feeds_attention = _upstream(self.index, query | key, ends)
        for tensor in self.hints.inputs:
            if not self.index.has_tensor(tensor.name) or tensor.name in feeds_attention:
                continue
            reached = self.index.computed_from([tensor.name], ends=ends, through_shapes=False)
            reached_masks = sorted(reached & masks)
            if reached_masks and not reached & (query | key):
                reached_axes = self._axes_reached([(tensor.name, tensor.seq_len_idx)], masks)
                walks.mask_only.append((tensor, reached_masks, reached_axes))
        return walks

    def _axes_reached(
        self, starts: list[tuple[str, int]], masks: set[str], stop: set[str] | None = None
    ) -> dict[str, set[int]]:
        """The axes of ``masks`` that the axes ``starts`` (tensor, axis) become, followed
        forward through the ops that map them, not past ``stop`` (none where an op in between
        merges the axis with another, as TorchScript's BERT flattens its padding mask)."""
        if self.shapes is None:
            return {}
        if self._mapper is None:
            layers = list(self.by_q.values())
            self._mapper = AxisMapper(self.index, self.shapes, sequence_dim(self.shapes, layers))
        mapper = self._mapper
        queue, seen = deque(starts), set(starts)
        reached: dict[str, set[int]] = {}
        while queue:
            name, axis = queue.popleft()
            if name in masks:
                reached.setdefault(name, set()).add(axis)
                continue
            if stop is not None and name in stop:
                continue
            for node in self.index.consumers_of(name):
                output = node.outputs[0] if node.outputs else ""
                if not output or node.op_type in SHAPE_OPS:
                    continue
                out_axis = mapper.output_axis(node, name, axis)
                if out_axis is not None and (output, out_axis) not in seen:
                    seen.add((output, out_axis))
                    queue.append((output, out_axis))
        return reached

    def _unhinted_inputs(
        self,
        changing: Callable[[str], list[int] | None],
        first: dict[str, tuple[int, ...]],
        walks: _Walks,
    ) -> None:
        query, key, masks = walks.query, walks.key, walks.masks
        hinted = {t.name for t in self.hints.inputs}
        for name, reached in walks.input_reach.items():
            axes = changing(name)
            if not axes:
                continue
            if reached & (query | key):
                self.report.add(
                    "SC115",
                    ERROR,
                    "inputs",
                    f"graph input {name!r} carries the sequence and reaches the "
                    f"{'query' if reached & query else 'key/value'} side of an attention layer "
                    "without passing a hinted tensor: it must be scattered (add it, or a tensor "
                    "computed from it, to inputs)",
                    tensor=name,
                    expected="scattered",
                    observed="whole",
                )
            elif reached & masks:
                # Each rank computes the masks whole from it: right for their key axes only.
                reached_axes = self._axes_reached([(name, a) for a in axes], masks, hinted)
                over_queries = sorted(
                    mask
                    for mask, mask_axes in reached_axes.items()
                    if len(first.get(mask, ())) - 2 in mask_axes
                )
                if over_queries:
                    self.report.add(
                        "SC115",
                        ERROR,
                        "inputs",
                        f"graph input {name!r} carries the sequence and becomes the query axis "
                        f"of the mask {over_queries[0]} without passing a hinted tensor: each "
                        "rank would hold all of its rows; scatter a tensor on the way from the "
                        "input to that axis, one not also on the way to the mask's key axis",
                        tensor=name,
                        expected="scattered",
                        observed="whole",
                    )
                    continue
                self.report.add(
                    "SC119",
                    INFO,
                    "inputs",
                    f"graph input {name!r} carries the sequence but reaches only the key side "
                    "(a mask over the keys): it stays whole on every rank, which is right",
                    tensor=name,
                    expected="whole",
                    observed="whole",
                )

    def _key_only_inputs(self, first: dict[str, tuple[int, ...]], walks: _Walks) -> None:
        """A hinted tensor that reaches no Q, K or V, only masks, and whose hinted axis becomes
        the key axis of one: scattering it cuts that mask over the keys, which must stay whole
        since K and V are gathered whole. (Scattering such a mask along its query axis is
        right: each rank gets its rows.) Where the axis cannot be followed to the masks, the
        masks' values decide: rows all equal (a mask over the keys), and the hinted axis lined
        up with their key axis."""

        def rows_over_keys(mask: str, tensor: ShardTensor) -> bool:
            value = self.mask_values.get(mask)
            rank = len(first.get(tensor.name, ()))
            if value is None or value.ndim < 2 or not rank:
                return False
            rows_equal = np.array_equal(value, np.broadcast_to(value[..., :1, :], value.shape))
            aligned = tensor.seq_len_idx + value.ndim - rank
            return rows_equal and aligned == value.ndim - 1

        for tensor, reached_masks, axes in walks.mask_only:
            axis = tensor.seq_len_idx
            if axes:
                over_keys = sorted(m for m in axes if len(first.get(m, ())) - 1 in axes[m])
                if not over_keys:
                    continue
                why = f"its axis {axis} becomes the key axis of the mask {over_keys[0]}"
            elif all(rows_over_keys(mask, tensor) for mask in reached_masks):
                why = (
                    f"its axis {axis} lines up with the key axis of the mask {reached_masks[0]}, "
                    "whose rows are all equal (a mask over the keys)"
                )
            else:
                continue
            self.report.add(
                "SC116",
                ERROR,
                f"inputs[name={tensor.name}]",
                f"{tensor.name!r} reaches no Q, K or V, only masks, and {why}; scattering it "
                "cuts the mask over the keys while K and V are gathered whole: leave it out of "
                "inputs",
                tensor=tensor.name,
                expected="not scattered",
                observed="scattered",
            )


@dataclass
class _Walks:
    """What the comparison needs of the graph: the attention inputs, what each unhinted graph
    input reaches, and the hinted tensors that reach only masks."""

    query: set[str]
    key: set[str]
    masks: set[str]
    input_reach: dict[str, set[str]] = field(default_factory=dict)
    # Each hinted tensor that reaches only masks, with those masks and the axes of theirs
    # that its hinted axis becomes (where it can be followed).
    mask_only: list[tuple[ShardTensor, list[str], dict[str, set[int]]]] = field(
        default_factory=list
    )


def _attention_sides(
    index: GraphIndex, by_q: dict[str, AttentionLayer], hints: ShardHints
) -> tuple[set[str], set[str], set[str]]:
    """The layers' Q; their K and V; their masks, with what else a fused attention node reads
    beside Q, K and V from data (a mask over the keys: key_padding_mask, mask_index), which
    ends the walks as the masks do instead of leading through the node to the next layer."""
    layers = [by_q[h.q] for h in hints.attention_layers if h.q in by_q] or list(by_q.values())
    query = {layer.q for layer in layers}
    key = {layer.gathered_k for layer in layers} | {layer.gathered_v for layer in layers}
    masks = {m for layer in layers for m in layer.masks}
    for layer in layers:
        if layer.kind == "fused":
            node = index.nodes[layer.internal[0]]
            sides = {layer.q, layer.gathered_k, layer.gathered_v}
            masks.update(
                name
                for name in node.inputs
                if name and name not in sides and index.constant_tensor(name) is None
            )
    return query, key, masks


def _upstream(index: GraphIndex, targets: set[str], ends: set[str]) -> set[str]:
    """Every tensor from which ``computed_from`` (with these ``ends``, through data only)
    would reach a target: a walk back through data (not Shape), not going on past an end."""
    found = set(targets)
    queue = deque(targets)
    while queue:
        tensor = queue.popleft()
        producer = index.producer_of(tensor)
        if producer is None or producer.op_type in SHAPE_OPS:
            continue
        for name in producer.inputs:
            if name and name not in found:
                found.add(name)
                if name not in ends:
                    queue.append(name)
    return found


def watched_tensors(
    index: GraphIndex, hints: ShardHints, by_q: dict[str, AttentionLayer]
) -> dict[str, str]:
    """The tensors the runs expose and compare: tensor -> why it is watched (hint field)."""
    watched: dict[str, str] = {}
    for kind, tensors in (("inputs", hints.inputs), ("outputs", hints.outputs)):
        for t in tensors:
            if index.has_tensor(t.name):
                watched.setdefault(t.name, f"{kind}[name={t.name}]")
    for hint in hints.attention_layers:
        layer = by_q.get(hint.q)
        if layer is not None:
            watched.setdefault(layer.q, f"attention_layers[q={hint.q}]")
            watched.setdefault(layer.gathered_k, "k_seq_len_idx")
            watched.setdefault(layer.gathered_v, "v_seq_len_idx")
            for mask in layer.masks:
                watched.setdefault(mask, "mask")
    for name in index.graph_inputs:
        watched.setdefault(name, "graph input")
    return watched


class PendingSession:
    """The onnxruntime session of the runs, made in the background from the start.

    Making the session (loading the model, making its kernels) is most of verify's onnxruntime
    time, and onnxruntime releases the GIL while it does it: the analysis (shape inference,
    detection, the static checks) runs meanwhile. The model with the watched tensors as outputs
    is serialized here, in the caller's thread, since that reads the index's model.
    """

    def __init__(
        self,
        index: GraphIndex,
        model_path: Path,
        watched: dict[str, str],
        serialized: bytes | None = None,
    ) -> None:
        self.watched = watched
        extra = [name for name in watched if name not in index.graph_inputs]
        check_weight_files(index, model_path)
        model = _with_outputs(index, extra, serialized)
        self._making = InBackground(
            "shardcheck-session", _session, model, weights_dir(model_path), index.source
        )

    def settle(self) -> None:
        """Wait until onnxruntime has made the session, or failed to (its error is not
        raised here)."""
        self._making.wait()

    def session(self, progress: Progress | None = None) -> _Session:
        """The session, once made; ``progress`` hears when that takes more than a second."""
        if progress is not None and not self._making.wait(1.0):
            progress("onnxruntime is still loading the model...")
        return self._making.result()


class _Session:
    def __init__(self, session: Any, source: str) -> None:
        self.session = session
        self.source = source  # the model file, for messages
        self.outputs = [o.name for o in session.get_outputs()]
        self.last: tuple[list[str], list[np.ndarray]] = ([], [])


def _session(model: bytes, weights_dir: Path, source: str) -> _Session:
    try:
        session = make_session(model, weights_dir)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise InputError(
            f"{source}: onnxruntime cannot load the model: {_short(str(exc))}"
        ) from None
    return _Session(session, source)


def _run(
    session: _Session,
    feeds: dict[str, np.ndarray],
    timeout: float | None,
    progress: Progress | None,
    length: int,
) -> str | None:
    """Run once; the error message on failure. A timeout cancels the run."""
    import onnxruntime

    run_options = onnxruntime.RunOptions()
    timers: list[threading.Timer] = []
    if progress is not None:
        timers.append(
            threading.Timer(
                1.0, progress, args=(f"running onnxruntime at sequence length {length}...",)
            )
        )
    if timeout is not None:
        timers.append(threading.Timer(timeout, lambda: setattr(run_options, "terminate", True)))
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        values = session.session.run(session.outputs, feeds, run_options)
    except Exception as exc:  # onnxruntime raises its own exception types
        if run_options.terminate:
            raise InputError(
                f"{session.source}: onnxruntime did not finish within --timeout {timeout} s "
                f"(sequence length {length}); give it more time or use shorter --seq-lens"
            ) from None
        return " ".join(str(exc).split())
    finally:
        for timer in timers:
            timer.cancel()
    session.last = (session.outputs, values)
    return None


def _with_outputs(
    index: GraphIndex, extra: Iterable[str], serialized: bytes | None = None
) -> bytes:
    """The serialized model with ``extra`` tensors as outputs too; external weights stay in
    their files (onnxruntime reads them there).

    ``serialized``: the model file's own bytes, when it is a protobuf whose weights are all
    inside it. Then nothing is serialized: protobuf merges a message read after another into
    it, appending to repeated fields, so the file's bytes followed by a ModelProto holding only
    the new graph outputs read as the model with those outputs added.
    """
    present = {o.name for o in index.model.graph.output}
    added = []
    for name in extra:
        if name not in present and name not in index.initializers:
            added.append(onnx.ValueInfoProto(name=name))
            present.add(name)
    if serialized is not None:
        return serialized + onnx.ModelProto(graph=onnx.GraphProto(output=added)).SerializeToString()
    # The index's own model is lent: it gets the outputs for the time of the serialization.
    outputs = index.model.graph.output
    declared = len(outputs)
    try:
        outputs.extend(added)
        return index.model.SerializeToString()
    finally:
        del outputs[declared:]


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."
