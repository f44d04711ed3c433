"""``verify``: do the hints fit the model? Static checks, then onnxruntime at several lengths.

The static part reads only the graph index. The runtime part runs the model once per sequence
length with every hinted tensor, and each layer's Q and gathered K and V, exposed as outputs,
and compares shapes across the runs: the axis that changes with the length is the sequence axis,
whatever the dims are called. With ``ranks``, the CP simulation runs as well.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from shardcheck.budget import check_memory
from shardcheck.detect import AttentionLayer, detect_attention
from shardcheck.errors import InputError
from shardcheck.feeds import (
    BATCH_DIM_DEFAULT,
    BATCH_LIKE,
    OTHER_DIM_DEFAULT,
    graph_input_dims,
    make_feeds,
    resolve_dims,
)
from shardcheck.graph import GraphIndex
from shardcheck.hints import REDUCE_OPS, ShardHints, ShardTensor
from shardcheck.hints_file import read_hints
from shardcheck.loader import load_index
from shardcheck.report import ERROR, INFO, WARNING, Report
from shardcheck.shapes import ShapeInference

DEFAULT_SEQ_LENS = (8, 16)
_ORT_NODE = re.compile(r"Name:'([^']*)'")
Progress = Callable[[str], None]


def verify(
    model_path: str | os.PathLike[str],
    hints: ShardHints | str | os.PathLike[str],
    *,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    dims: Mapping[str, int] | None = None,
    ranks: int | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    timeout: float | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> Report:
    """Check ``hints`` against ``model_path``; every finding is collected, not only the first."""
    if len(seq_lens) < 2 or len(set(seq_lens)) != len(seq_lens) or min(seq_lens) < 1:
        raise InputError(
            f"--seq-lens {','.join(map(str, seq_lens))}: give at least two different positive "
            "lengths, e.g. 8,16"
        )
    # threading.Timer takes no NaN, infinity or wait past TIMEOUT_MAX (it fails in its thread).
    if timeout is not None and not 0 < timeout <= threading.TIMEOUT_MAX:
        raise InputError(
            f"--timeout {timeout}: expected a positive number of seconds "
            f"(at most {threading.TIMEOUT_MAX:.0f})"
        )
    for option, value in (("--rtol", rtol), ("--atol", atol)):
        if not 0 <= value < math.inf:  # NaN too: every comparison with it is false
            raise InputError(f"{option} {value}: expected a finite number >= 0")
    if ranks is not None:
        bad = [n for n in seq_lens if n % ranks]
        if ranks < 1 or bad:
            raise InputError(
                f"--ranks {ranks}: every sequence length must divide by the number of ranks "
                f"({', '.join(map(str, bad or seq_lens))} does not); choose --seq-lens accordingly"
            )
    index = load_index(model_path)
    hints_source = "<hints>" if isinstance(hints, ShardHints) else str(hints)
    hints = hints if isinstance(hints, ShardHints) else read_hints(hints)
    report = Report(model=str(model_path), hints=hints_source)
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    by_q = {layer.q: layer for layer in layers}

    check_static(index, shapes, hints, layers, report)
    choose = _dim_chooser(index, shapes, layers, hints, dict(dims or {}))
    runtime = _RuntimeCheck(index, hints, by_q, report, seed, timeout, progress, shapes=shapes)
    runtime.run(Path(model_path), list(seq_lens), choose)
    if ranks is not None and runtime.ran:
        _simulate(model_path, hints, ranks, seq_lens, choose, rtol, atol, seed, report, progress)
    return report


DimChooser = Callable[[int], dict[str, int]]


def _dim_chooser(
    index: GraphIndex,
    shapes: ShapeInference,
    layers: list[AttentionLayer],
    hints: ShardHints,
    user_dims: dict[str, int],
) -> DimChooser:
    """The dims of each run. The sequence dim is the one the attention's query axis carries,
    found from the model, not from the hints under test (wrong hints would otherwise pick the
    dim that is varied, and a wrong axis could pass). Without attention, the hints decide."""
    names = graph_input_dims(index)
    sequence = None
    for layer in layers:
        q_shape = shapes.shape(layer.q)
        if q_shape is not None and layer.q_axis is not None:
            dim = q_shape[layer.q_axis]
            if isinstance(dim, str) and dim in names:
                sequence = dim
                break
    if sequence is None:
        # The query axis did not resolve to a dim name: one non-batch dim among the inputs is
        # still the model's own answer; only with several do the hints decide.
        candidates = [name for name in names if not BATCH_LIKE.search(name)]
        sequence = candidates[0] if len(candidates) == 1 else None
    if sequence is None or sequence in user_dims:
        return lambda length: resolve_dims(index, hints, length, user_dims)
    unknown = sorted(set(user_dims) - set(names))
    if unknown:
        raise InputError(
            f"{index.source}: --dim {unknown[0]}: the model's inputs have no such dim "
            f"(their symbolic dims: {', '.join(names) or 'none'})"
        )

    def choose(length: int) -> dict[str, int]:
        return {
            name: user_dims.get(name, length if name == sequence else _default_dim(name))
            for name in names
        }

    return choose


def _default_dim(name: str) -> int:
    return BATCH_DIM_DEFAULT if BATCH_LIKE.search(name) else OTHER_DIM_DEFAULT


# --------------------------------------------------------------------------- static checks


def check_static(
    index: GraphIndex,
    shapes: ShapeInference,
    hints: ShardHints,
    layers: list[AttentionLayer],
    report: Report,
) -> None:
    by_q = {layer.q: layer for layer in layers}
    for kind, tensors in (("inputs", hints.inputs), ("outputs", hints.outputs)):
        for tensor in tensors:
            _check_tensor(index, shapes, kind, tensor, report)
    for position, hint in enumerate(hints.attention_layers):
        if hint.q not in by_q:
            where = "a tensor of the model" if index.has_tensor(hint.q) else "not in the model"
            report.add(
                "SC108",
                ERROR,
                f"attention_layers[q={hint.q}]",
                f"attention_layers[{position}].q {hint.q!r} is {where}, but not the Q of any "
                "attention layer found in it (the first input of a score MatMul or of a fused "
                "attention node)",
                tensor=hint.q,
                expected="Q of a layer",
                observed="no layer",
            )
    hinted = {hint.q for hint in hints.attention_layers}
    for layer in layers:
        if layer.q not in hinted:
            report.add(
                "SC109",
                ERROR,
                "attention_layers",
                f"attention layer {layer.name} (Q {layer.q}) is not in the hints: its K and V "
                "would not be gathered, so it would attend to local positions only",
                tensor=layer.q,
                expected="hinted",
                observed="missing",
            )
        elif not layer.polygraphy_recognises:
            report.add(
                "SC110",
                WARNING,
                f"attention_layers[q={layer.q}]",
                f"layer {layer.name} matches neither of Polygraphy's attention patterns: "
                "'polygraphy multi-device shard' will skip it and compute it over local K/V "
                "only ('shardcheck shard' handles it)",
                tensor=layer.q,
            )
    _check_kv(hints, [by_q[h.q] for h in hints.attention_layers if h.q in by_q], report)
    _check_layers(hints, shapes, by_q, report)
    _check_collectives(hints, report)


def _check_tensor(
    index: GraphIndex, shapes: ShapeInference, kind: str, tensor: ShardTensor, report: Report
) -> None:
    field = f"{kind}[name={tensor.name}]"
    if not index.has_tensor(tensor.name):
        report.add(
            "SC102",
            ERROR,
            f"{field}.name",
            f"{kind} tensor {tensor.name!r} is not a tensor of the model (renamed by a re-export?)",
            tensor=tensor.name,
            expected="a tensor of the model",
            observed="absent",
        )
        return
    rank = shapes.rank(tensor.name)
    if rank is not None and tensor.seq_len_idx >= rank:
        report.add(
            "SC103",
            ERROR,
            f"{field}.seq_len_idx",
            f"seq_len_idx {tensor.seq_len_idx} of {tensor.name!r} is outside its rank {rank}",
            tensor=tensor.name,
            expected=f"< {rank}",
            observed=tensor.seq_len_idx,
        )
    if rank is not None and tensor.rank is not None and tensor.rank != rank:
        report.add(
            "SC104",
            ERROR,
            f"{field}.rank",
            f"rank {tensor.rank} given for {tensor.name!r}, the model says {rank}",
            tensor=tensor.name,
            expected=rank,
            observed=tensor.rank,
        )


def _check_kv(hints: ShardHints, layers: list[AttentionLayer], report: Report) -> None:
    for what, code, hinted, axis_of in (
        ("k_seq_len_idx", "SC105", hints.k_seq_len_idx, lambda layer: layer.k_axis),
        ("v_seq_len_idx", "SC106", hints.v_seq_len_idx, lambda layer: layer.v_axis),
    ):
        wrong = [layer for layer in layers if axis_of(layer) not in (None, hinted)]
        if wrong:
            needed = sorted({axis_of(layer) for layer in wrong})
            report.add(
                code,
                ERROR,
                what,
                f"{what} is {hinted}, but the gathered tensor of layer {wrong[0].name} has the "
                f"sequence on axis {axis_of(wrong[0])} (MatMul's K is [..., D, S] when the model "
                f"computes q @ k^T); {len(wrong)} layer(s) affected",
                tensor=wrong[0].gathered_k if code == "SC105" else wrong[0].gathered_v,
                expected=", ".join(map(str, needed)),
                observed=hinted,
            )
    ranks = {layer.k_rank for layer in layers} | {layer.v_rank for layer in layers}
    ranks.discard(None)
    if hints.kv_rank is not None and ranks and hints.kv_rank not in ranks:
        report.add(
            "SC107",
            ERROR,
            "kv_rank",
            f"kv_rank is {hints.kv_rank}, the gathered K/V have rank {sorted(ranks)}",
            expected=", ".join(map(str, sorted(ranks))),
            observed=hints.kv_rank,
        )


def _check_layers(
    hints: ShardHints, shapes: ShapeInference, by_q: dict[str, AttentionLayer], report: Report
) -> None:
    gather_q = {hint.gather_q for hint in hints.attention_layers}
    if len(gather_q) > 1:
        report.add(
            "SC111",
            ERROR,
            "attention_layers[*].gather_q",
            "gather_q differs between layers; Polygraphy's shard decides the final all-gather "
            "from any layer, so it must be the same on every layer",
            expected="the same on every layer",
            observed="true and false",
        )
    for hint in hints.attention_layers:
        if hint.replace is None:
            continue
        layer = by_q.get(hint.q)
        for name, shuffle, tensor in (
            ("q_shuffle", hint.replace.q_shuffle, layer.q if layer else None),
            ("k_shuffle", hint.replace.k_shuffle, layer.k if layer else None),
            ("v_shuffle", hint.replace.v_shuffle, layer.v if layer else None),
        ):
            if not shuffle:
                continue
            rank = shapes.rank(tensor) if tensor else None
            expected_len = rank if rank is not None else len(shuffle)
            if sorted(shuffle) != list(range(len(shuffle))) or len(shuffle) != expected_len:
                report.add(
                    "SC112",
                    ERROR,
                    f"attention_layers[q={hint.q}].replace.{name}",
                    f"{name} {list(shuffle)} is not a permutation of the {expected_len} axes",
                    expected=f"a permutation of 0..{expected_len - 1}",
                    observed=list(shuffle),
                )


def _check_collectives(hints: ShardHints, report: Report) -> None:
    dist = hints.dist_collectives
    if dist.reduce_op not in REDUCE_OPS:
        report.add(
            "SC113",
            ERROR,
            "dist_collectives.reduce_op",
            "unknown reduce_op",
            observed=dist.reduce_op,
        )
    if dist.root != -1 and dist.group_size and dist.root >= dist.group_size:
        report.add(
            "SC113",
            ERROR,
            "dist_collectives.root",
            f"root {dist.root} is not a rank of a group of {dist.group_size}",
            expected=f"-1 or < {dist.group_size}",
            observed=dist.root,
        )
    if dist.reduce_op in ("sum", "prod") and hints.inputs:
        report.add(
            "SC114",
            ERROR,
            "dist_collectives.reduce_op",
            f"reduce_op {dist.reduce_op!r}: every rank holds the same whole copy of each hinted "
            "input, so reduce-scattering with sum or prod multiplies the values "
            f"({hints.inputs[0].name} first); use max, min or avg",
            tensor=hints.inputs[0].name,
            expected="max, min or avg",
            observed=dist.reduce_op,
        )


# --------------------------------------------------------------------------- runtime checks


class _RuntimeCheck:
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

    def watched(self) -> dict[str, str]:
        """Tensor -> why it is watched (hint field)."""
        watched: dict[str, str] = {}
        for kind, tensors in (("inputs", self.hints.inputs), ("outputs", self.hints.outputs)):
            for t in tensors:
                if self.index.has_tensor(t.name):
                    watched.setdefault(t.name, f"{kind}[name={t.name}]")
        for hint in self.hints.attention_layers:
            layer = self.by_q.get(hint.q)
            if layer is not None:
                watched.setdefault(layer.q, f"attention_layers[q={hint.q}]")
                watched.setdefault(layer.gathered_k, "k_seq_len_idx")
                watched.setdefault(layer.gathered_v, "v_seq_len_idx")
                for mask in layer.masks:
                    watched.setdefault(mask, "mask")
        for name in self.index.graph_inputs:
            watched.setdefault(name, "graph input")
        return watched

    def run(self, model_path: Path, seq_lens: list[int], choose: DimChooser) -> None:
        watched = self.watched()
        for length in seq_lens:  # every length fits in memory, or nothing runs
            check_memory(
                self.index,
                choose(length),
                seq_len=length,
                shapes=self.shapes,
                layers=self.by_q.values(),
                kept=watched,
            )
        model = _with_outputs(
            self.index, model_path, [n for n in watched if n not in self.index.graph_inputs]
        )
        session = _session(model, self.index.source)
        shapes_by_len: dict[int, dict[str, tuple[int, ...]]] = {}
        failures: dict[int, tuple[str, dict[str, int]]] = {}
        for length in seq_lens:
            dims = choose(length)
            feeds = make_feeds(self.index, dims, self.seed)
            started = time.perf_counter()
            failure = _run(session, feeds, self.timeout, self.progress, length)
            self.report.runs.append(
                {
                    "seq_len": length,
                    "dims": dims,
                    "seconds": time.perf_counter() - started,
                    "ok": failure is None,
                }
            )
            if failure is not None:
                failures[length] = (failure, dims)
                continue
            outputs, values = session.last
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
            self._failed(length, message, sorted(shapes_by_len), dims)
            return
        self.ran = True
        self._compare(shapes_by_len, seq_lens)

    def _found(self, code: str, field: str) -> bool:
        return any(f.code == code and f.field == field for f in self.report.findings)

    def _failed(self, length: int, message: str, ran_at: list[int], dims: dict[str, int]) -> None:
        match = _ORT_NODE.search(message)
        node = match.group(1) if match else "unknown node"
        chosen = ", ".join(f"{k}={v}" for k, v in dims.items())
        if ran_at:
            self.report.add(
                "SC002",
                ERROR,
                "model",
                f"the model runs at sequence length {', '.join(map(str, ran_at))} but not at "
                f"{length}: the length is baked into it (at node {node}); each CP rank runs a "
                f"shorter sequence, so it cannot be sharded. onnxruntime: {_short(message)}",
                tensor=node,
                expected="runs at any length",
                observed=f"fails at {length}",
            )
        else:
            self.report.add(
                "SC001",
                ERROR,
                "model",
                f"the model does not run in onnxruntime with {chosen} (node {node}): "
                f"{_short(message)}",
                tensor=node,
                expected="runs",
                observed="fails",
            )

    def _compare(self, shapes: dict[int, dict[str, tuple[int, ...]]], seq_lens: list[int]) -> None:
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
                field = f"{kind}[name={tensor.name}]"
                rank = len(first[tensor.name])
                if (
                    tensor.rank is not None
                    and tensor.rank != rank
                    and not self._found("SC104", f"{field}.rank")
                ):
                    self.report.add(
                        "SC104",
                        ERROR,
                        f"{field}.rank",
                        f"rank {tensor.rank} given for {tensor.name!r}; it has rank {rank}",
                        tensor=tensor.name,
                        expected=rank,
                        observed=tensor.rank,
                    )
                if not axes:
                    self.report.add(
                        "SC117",
                        ERROR,
                        f"{field}.seq_len_idx",
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
                        f"{field}.seq_len_idx",
                        f"{tensor.name!r} carries the sequence on axis {axes[0]} (shape "
                        f"{first[tensor.name]} at length {seq_lens[0]}, {second[tensor.name]} at "
                        f"{seq_lens[1]}), not on axis {tensor.seq_len_idx}",
                        tensor=tensor.name,
                        expected=axes[0],
                        observed=tensor.seq_len_idx,
                    )
        self._compare_layers(changing, first)
        self._unhinted_inputs(changing)
        self._key_only_inputs(first)

    def _compare_layers(self, changing: Callable[[str], list[int] | None], first: dict) -> None:
        for hint in self.hints.attention_layers:
            layer = self.by_q.get(hint.q)
            if layer is None:
                continue
            for code, field, tensor, hinted in (
                ("SC105", "k_seq_len_idx", layer.gathered_k, self.hints.k_seq_len_idx),
                ("SC106", "v_seq_len_idx", layer.gathered_v, self.hints.v_seq_len_idx),
            ):
                axes = changing(tensor)
                if axes and axes != [hinted] and not self._found(code, field):
                    self.report.add(
                        code,
                        ERROR,
                        field,
                        f"layer {layer.name}: the gathered tensor {tensor} changes with the "
                        f"sequence on axis {axes} (observed), the hints gather axis {hinted}",
                        tensor=tensor,
                        expected=axes[0],
                        observed=hinted,
                    )
            axes = changing(layer.q)
            rank = len(first.get(layer.q, ()))
            if axes is not None and axes != [rank - 2]:
                self.report.add(
                    "SC118",
                    WARNING,
                    f"attention_layers[q={hint.q}]",
                    f"layer {layer.name}: Q {layer.q} changes on axes {axes}, expected its "
                    f"query axis {rank - 2}",
                    tensor=layer.q,
                    expected=rank - 2,
                    observed=axes,
                )

    def _unhinted_inputs(self, changing: Callable[[str], list[int] | None]) -> None:
        hinted = {t.name for t in self.hints.inputs}
        query, key, masks = _attention_sides(self.by_q, self.hints)
        for name in self.index.graph_inputs:
            if name in hinted or not changing(name):
                continue
            reached = _reach(self.index, name, stop=hinted, ends=query | key | masks)
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

    def _key_only_inputs(self, first: dict[str, tuple[int, ...]]) -> None:
        """A hinted tensor that reaches no Q, K or V, only masks whose rows are all equal
        (masks over the keys), and whose hinted axis lines up with their key axis: scattering
        it cuts the mask over the keys, which must stay whole since K and V are gathered whole.
        (Scattering such a mask along its query axis is right: each rank gets its rows.)"""
        query, key, masks = _attention_sides(self.by_q, self.hints)

        def cut_over_keys(mask: str, tensor: ShardTensor) -> bool:
            value = self.mask_values.get(mask)
            rank = len(first.get(tensor.name, ()))
            if value is None or value.ndim < 2 or not rank:
                return False
            rows_equal = np.array_equal(value, np.broadcast_to(value[..., :1, :], value.shape))
            aligned = tensor.seq_len_idx + value.ndim - rank
            return rows_equal and aligned == value.ndim - 1

        ends = query | key | masks
        # Nearly every hinted tensor feeds Q, K or V: find those in one walk back, and follow
        # only the others forward.
        feeds_attention = _upstream(self.index, query | key, ends)
        for tensor in self.hints.inputs:
            if not self.index.has_tensor(tensor.name) or tensor.name in feeds_attention:
                continue
            reached = _reach(self.index, tensor.name, stop=set(), ends=ends)
            reached_masks = sorted(reached & masks)
            if reached & (query | key) or not reached_masks:
                continue
            if all(cut_over_keys(mask, tensor) for mask in reached_masks):
                self.report.add(
                    "SC116",
                    ERROR,
                    f"inputs[name={tensor.name}]",
                    f"{tensor.name!r} reaches no Q, K or V, only the mask {reached_masks[0]}, "
                    "whose rows are all equal (a mask over the keys); scattering it cuts the "
                    "mask over the keys while K and V are gathered whole: leave it out of inputs",
                    tensor=tensor.name,
                    expected="not scattered",
                    observed="scattered",
                )


def _attention_sides(
    by_q: dict[str, AttentionLayer], hints: ShardHints
) -> tuple[set[str], set[str], set[str]]:
    layers = [by_q[h.q] for h in hints.attention_layers if h.q in by_q] or list(by_q.values())
    query = {layer.q for layer in layers}
    key = {layer.gathered_k for layer in layers} | {layer.gathered_v for layer in layers}
    masks = {m for layer in layers for m in layer.masks}
    return query, key, masks


def _reach(index: GraphIndex, start: str, stop: set[str], ends: set[str]) -> set[str]:
    """Every tensor computed from ``start`` (through data, not through Shape), not passing
    the tensors in ``stop`` and not going on past those in ``ends`` (the attention inputs)."""
    found = {start}
    queue = deque([start])
    while queue:
        tensor = queue.popleft()
        if tensor in ends and tensor != start:
            continue
        for consumer in index.consumers_of(tensor):
            if consumer.op_type in ("Shape", "Size"):
                continue
            for output in consumer.outputs:
                if output and output not in found and output not in stop:
                    found.add(output)
                    queue.append(output)
    return found


def _upstream(index: GraphIndex, targets: set[str], ends: set[str]) -> set[str]:
    """Every tensor from which ``_reach`` (with these ``ends``) would reach a target: a walk
    back through data (not Shape), not going on past an end."""
    found = set(targets)
    queue = deque(targets)
    while queue:
        tensor = queue.popleft()
        producer = index.producer_of(tensor)
        if producer is None or producer.op_type in ("Shape", "Size"):
            continue
        for name in producer.inputs:
            if name and name not in found:
                found.add(name)
                if name not in ends:
                    queue.append(name)
    return found


class _Session:
    def __init__(self, session: Any) -> None:
        self.session = session
        self.outputs = [o.name for o in session.get_outputs()]
        self.last: tuple[list[str], list[np.ndarray]] = ([], [])


def _session(model: onnx.ModelProto, source: str) -> _Session:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4
    try:
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime raises its own exception types
        raise InputError(
            f"{source}: onnxruntime cannot load the model: {_short(str(exc))}"
        ) from None
    return _Session(session)


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
                f"onnxruntime did not finish within --timeout {timeout} s (sequence length "
                f"{length}); give it more time or use shorter --seq-lens"
            ) from None
        return " ".join(str(exc).split())
    finally:
        for timer in timers:
            timer.cancel()
    session.last = (session.outputs, values)
    return None


def _with_outputs(index: GraphIndex, path: Path, extra: Iterable[str]) -> onnx.ModelProto:
    """The model with ``extra`` tensors as outputs too, and its weights loaded."""
    model = onnx.ModelProto()
    model.CopyFrom(index.model)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(model, str(path.resolve().parent))
        except (OSError, onnx.checker.ValidationError) as exc:  # not a regular file
            raise InputError(f"{path}: cannot read its external weights: {exc}") from None
    present = {o.name for o in model.graph.output}
    for name in extra:
        if name not in present and name not in index.initializers:
            info = onnx.ValueInfoProto()
            info.name = name
            model.graph.output.append(info)
            present.add(name)
    return model


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _simulate(
    model_path: str | os.PathLike[str],
    hints: ShardHints,
    ranks: int,
    seq_lens: Sequence[int],
    choose: DimChooser,
    rtol: float,
    atol: float,
    seed: int,
    report: Report,
    progress: Progress | None,
) -> None:
    from shardcheck.simulate import simulate

    for length in seq_lens:
        if progress is not None:
            progress(f"simulating CP on {ranks} ranks at sequence length {length}...")
        started = time.perf_counter()
        result = simulate(
            model_path,
            hints,
            ranks=ranks,
            seq_len=length,
            dims=choose(length),
            rtol=rtol,
            atol=atol,
            seed=seed,
        )
        report.runs.append(
            {
                "simulation": True,
                "ranks": ranks,
                "seq_len": length,
                "ok": result.ok,
                "seconds": time.perf_counter() - started,
            }
        )
        if result.ok:
            report.add(
                "SC202",
                INFO,
                "simulation",
                f"{ranks} simulated ranks at length {length} match the single-device run "
                f"(largest difference {result.max_abs_error:.3g})",
                expected="match",
                observed="match",
            )
        else:
            report.add(
                "SC201",
                ERROR,
                "simulation",
                result.summary(),
                tensor=result.mismatch.tensor if result.mismatch else "",
                expected="match",
                observed="differs",
            )
            return
