"""verify's onnxruntime checks: runs at several lengths, and what their shapes say.

The model runs once per sequence length with every hinted tensor, each layer's Q and gathered
K and V and its masks exposed as outputs; the axis that changes with the length is the sequence
axis, whatever the dims are called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.errors import InputError
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints, ShardTensor
from shardcheck.runtime.feeds import make_feeds
from shardcheck.runtime.memory import refuse_oversized_run
from shardcheck.runtime.sessions import error_text, failed_node
from shardcheck.verification.findings import ERROR, INFO, WARNING, Report
from shardcheck.verification.session import (
    MESSAGE_LIMIT,
    PendingSession,
    Progress,
    WatchedSession,
)
from shardcheck.verification.static_checks import check_given_rank
from shardcheck.verification.walks import AxesToMasks, Walks, graph_walks
from shardcheck.wording import listed

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
        self._walks: Walks | None = None
        # For the few tensors whose axis is followed to the masks (asked in prepare and run).
        self._axes = AxesToMasks(index, shapes, by_q.values())

    def prepare(self, pending: PendingSession, seq_lens: list[int], choose: DimChooser) -> None:
        """What needs no run, done while the session is made: every length fits in memory,
        or nothing runs (InputError), and the graph walks of the comparison."""
        # Only the sequence dim differs between the runs and no tensor shrinks as it grows:
        # the longest run is the one to check.
        longest = max(seq_lens)
        refuse_oversized_run(
            self.index,
            choose(longest),
            seq_len=longest,
            shapes=self.shapes,
            layers=self.by_q.values(),
            kept=pending.watched,
        )
        self._walks = graph_walks(self.index, self.hints, self.by_q, self._axes)

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
            failure = session.run(feeds, self.timeout, self.progress, length)
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
        self._check_axes(shapes_by_len, seq_lens, walks)

    def _refuse_past_longest(
        self,
        session: WatchedSession,
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
        if session.run(make_feeds(self.index, dims, self.seed), self.timeout, None, shorter):
            return
        blamed = failed_node(message)
        node = f" (at node {blamed})" if blamed is not None else ""
        raise InputError(
            f"{self.index.source}: the model runs at sequence lengths "
            f"{listed([str(n) for n in (shorter, *ran_at)])} but not at {length}{node}: "
            f"{length} is past the longest it supports (the size of a position table, say); "
            f"choose shorter --seq-lens. onnxruntime: {_shortened(message)}"
        )

    def _failed(self, length: int, message: str, ran_at: list[int], dims: dict[str, int]) -> None:
        blamed = failed_node(message)
        node = blamed if blamed is not None else "unknown node"
        if ran_at:
            # Reported by check_baked, once verify knows whether CP was simulated there.
            self.baked = BakedLength(tuple(ran_at), length, node, _shortened(message))
            return
        chosen = ", ".join(f"{k}={v}" for k, v in dims.items())
        self.report.add(
            "SC001",
            ERROR,
            "model",
            f"the model does not run in onnxruntime with {chosen} (node {node}); if it "
            "needs other sizes (an audio encoder's convolutions need hundreds of samples), "
            f"give them with --seq-lens and --dim. onnxruntime: {_shortened(message)}",
            tensor=node,
            expected="runs",
            observed="fails",
        )

    def check_baked(self, simulated: bool | None, ranks: int | None) -> None:
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
                "holds it: simulate CP there (verify without --no-simulate), or export the "
                "model with a dynamic sequence axis"
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

    def _check_axes(
        self,
        shapes: dict[int, dict[str, tuple[int, ...]]],
        seq_lens: list[int],
        walks: Walks,
    ) -> None:
        """The findings of the shapes at the first two lengths: the axes that change with the
        length against those the hints name."""
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
                if not self.report.has("SC104", f"{hint_field}.rank"):
                    check_given_rank(
                        self.report, hint_field, tensor, rank, known_as="; it has rank {rank}"
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
        self._check_layers(changing, first)
        self._check_unhinted_inputs(changing, first, walks)
        self._check_key_only_inputs(first, walks)

    def _check_layers(self, changing: Callable[[str], list[int] | None], first: dict) -> None:
        for hint in self.hints.attention_layers:
            layer = self.by_q.get(hint.q)
            if layer is None:
                continue
            for code, hint_field, tensor, hinted in (
                ("SC105", "k_seq_len_idx", layer.gathered_k, self.hints.k_seq_len_idx),
                ("SC106", "v_seq_len_idx", layer.gathered_v, self.hints.v_seq_len_idx),
            ):
                axes = changing(tensor)
                if axes and axes != [hinted] and not self.report.has(code, hint_field):
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
            # A Q that does not change with the length is a fixed number of queries (learned
            # latents), held whole: no query axis to check.
            if axes and axes != [query]:
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

    def _check_unhinted_inputs(
        self,
        changing: Callable[[str], list[int] | None],
        first: dict[str, tuple[int, ...]],
        walks: Walks,
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
                reached_axes = self._axes.reached([(name, a) for a in axes], masks, hinted)
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

    def _check_key_only_inputs(self, first: dict[str, tuple[int, ...]], walks: Walks) -> None:
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


def _shortened(message: str) -> str:
    return error_text(message, limit=MESSAGE_LIMIT)
