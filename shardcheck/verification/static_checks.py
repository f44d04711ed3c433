"""verify's static checks: what the hints say against what the graph index says, no runs."""

from __future__ import annotations

import re
from collections import deque

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.fusion import pattern1_layers
from shardcheck.analysis.hidden import describe, hidden_attention, what_to_do
from shardcheck.analysis.selections import baked_counts, describe_baked
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints, ShardTensor, is_permutation
from shardcheck.verification.findings import ERROR, WARNING, Report
from shardcheck.verification.fused_checks import check_fused
from shardcheck.wording import counted


def check_static(
    index: GraphIndex,
    shapes: ShapeInference,
    hints: ShardHints,
    layers: list[AttentionLayer],
    report: Report,
    ranks: int | None = None,
) -> None:
    """Add to ``report`` what the hints get wrong by the graph alone: tensors, axes, ranks,
    layers, collectives, fused replacements (against ``ranks``, the ranks simulated)."""
    by_q = {layer.q: layer for layer in layers}
    # A fused hint may name a layer as Polygraphy's pattern 1 does: its Q before the scale.
    pattern1 = pattern1_layers(
        index, (h.q for h in hints.attention_layers if h.replace and h.q not in by_q), layers
    )
    by_q.update({q: layer for q, (layer, _) in pattern1.items()})
    check_fused(index, shapes, hints, by_q, report, ranks, pattern1)
    if hints.parallelism != "CP":
        report.add(
            "SC123",
            WARNING,
            "parallelism",
            f"parallelism {hints.parallelism!r}: shardcheck checks and shards context "
            "parallelism only; the other checks read these hints as CP hints",
            expected="CP",
            observed=hints.parallelism,
        )
    hidden = hidden_attention(index.model)
    if hidden:
        report.add(
            "SC129",
            ERROR,
            "model",
            f"attention that verify does not search, and that no hint can name, in "
            f"{describe(hidden)}: these hints shard none of it, and nothing here checks it. "
            f"To shard it, {what_to_do(hidden)}",
            expected="attention in the main graph",
            observed=counted(len(hidden), "place"),
        )
    baked = baked_counts(shapes)
    if baked:
        split, nonzero = baked[0]
        report.add(
            "SC003",
            WARNING,
            "model",
            describe_baked(shapes, baked),
            tensor=nonzero.outputs[0],
            expected="a count known at run time",
            observed=f"Split {split.label} into {len(split.outputs)}",
        )
    if not hints.inputs:
        report.add(
            "SC125",
            WARNING,
            "inputs",
            "the hints scatter no tensor: every rank would compute the whole model, which is "
            "no context parallelism"
            + ("" if layers else " (and no attention layer was found in the model)"),
            expected="a scattered tensor",
            observed="none",
        )
    for kind, tensors in (("inputs", hints.inputs), ("outputs", hints.outputs)):
        for tensor in tensors:
            _check_tensor(index, shapes, kind, tensor, report)
    for position, hint in enumerate(hints.attention_layers):
        if hint.q not in by_q:
            present = index.has_tensor(hint.q)
            why = (
                "is a tensor of the model, but not the Q of any attention layer found in it "
                "(the first input of a score MatMul or of a fused attention node)"
                if present
                else "is not a tensor of the model (renamed by a re-export?)"
            )
            report.add(
                "SC108",
                ERROR,
                f"attention_layers[q={hint.q}]",
                f"attention_layers[{position}].q {hint.q!r} {why}",
                tensor=hint.q,
                expected="Q of a layer",
                observed="no layer" if present else "absent",
            )
    hinted = {hint.q for hint in hints.attention_layers} | {
        layer.q for layer, _ in pattern1.values()
    }
    # Only K or V computed from a scattered tensor is split across the ranks and needs the
    # layer's gather (cross-attention over a whole memory needs none).
    scattered = _Scattered(index, hints, shapes, layers)
    for layer in layers:
        if layer.q not in hinted:
            if not scattered.reaches(layer):
                continue
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
    ungathered = [
        by_q[hint.q]
        for hint in hints.attention_layers
        if hint.q in by_q and not hint.gather_kv and hint.replace is None
    ]
    for layer in ungathered:
        if scattered.reaches(layer):
            report.add(
                "SC121",
                ERROR,
                f"attention_layers[q={layer.q}].gather_kv",
                f"layer {layer.name} is hinted with gather_kv false and no fused replacement: "
                "its K and V, computed from scattered tensors, would not be gathered, so it "
                "would attend to local positions only",
                tensor=layer.q,
                expected="true",
                observed="false",
            )
    # A fused layer's K and V are gathered inside the op: the K/V indices are not its.
    natives = [h for h in hints.attention_layers if h.q in by_q and h.replace is None]
    _check_kv(hints, [by_q[h.q] for h in natives], report)
    _check_layers(hints, shapes, by_q, report)
    _check_collectives(hints, report)
    _check_scattered_and_gathered(hints, report)


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
    shape = shapes.shape(tensor.name) or ()
    dim = shape[tensor.seq_len_idx] if tensor.seq_len_idx < len(shape) else None
    if isinstance(dim, str) and dim.isidentifier() and BATCH_LIKE.search(dim):
        report.add(
            "SC117",
            ERROR,
            f"{field}.seq_len_idx",
            f"axis {tensor.seq_len_idx} of {tensor.name!r} is its batch dim {dim!r}, not a "
            "sequence axis",
            tensor=tensor.name,
            expected="a sequence axis",
            observed=dim,
        )
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
    if rank is not None:
        check_given_rank(report, field, tensor, rank, known_as=", the model says {rank}")


def _check_kv(hints: ShardHints, layers: list[AttentionLayer], report: Report) -> None:
    for what, code, hinted, axis_of, rank_of, why in (
        (
            "k_seq_len_idx",
            "SC105",
            hints.k_seq_len_idx,
            lambda layer: layer.k_axis,
            lambda layer: layer.k_rank,
            " (MatMul's K is [..., D, S] when the model computes q @ k^T)",
        ),
        (
            "v_seq_len_idx",
            "SC106",
            hints.v_seq_len_idx,
            lambda layer: layer.v_axis,
            lambda layer: layer.v_rank,
            "",
        ),
    ):
        # Past every layer's rank; past some only, SC105/SC106 name the layers.
        ranks = sorted({rank_of(layer) for layer in layers} - {None})
        if ranks and hinted >= ranks[-1]:
            report.add(
                "SC103",
                ERROR,
                what,
                f"{what} {hinted} is outside the rank {ranks[-1]} of the gathered "
                f"{what[0].upper()}{' (its largest)' if len(ranks) > 1 else ''}",
                expected=f"< {ranks[-1]}",
                observed=hinted,
            )
        wrong = [layer for layer in layers if axis_of(layer) not in (None, hinted)]
        if wrong:
            needed = sorted({axis_of(layer) for layer in wrong})
            affected = counted(len(wrong), "layer")
            report.add(
                code,
                ERROR,
                what,
                f"{what} is {hinted}, but the gathered tensor of layer {wrong[0].name} has the "
                f"sequence on axis {axis_of(wrong[0])}{why}; {affected} affected",
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
            f"kv_rank is {hints.kv_rank}, but the gathered K and V have rank "
            f"{' and '.join(map(str, sorted(ranks)))}",
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
        causal = layer is not None and layer.causal is not None
        if layer is not None and hint.replace.is_causal != causal:
            report.add(
                "SC124",
                ERROR,
                f"attention_layers[q={hint.q}].replace.is_causal",
                f"layer {layer.name}: the fused attention is told is_causal "
                f"{str(hint.replace.is_causal).lower()}, but the layer's mask is "
                f"{f'causal ({layer.causal})' if causal else 'not causal'}",
                expected=str(causal).lower(),
                observed=str(hint.replace.is_causal).lower(),
            )
        for name, shuffle, tensor in (
            ("q_shuffle", hint.replace.q_shuffle, layer.q if layer else None),
            # Polygraphy's fused replacement transposes the attention's own K and V inputs
            # (the score and context MatMuls'), those native CP gathers.
            ("k_shuffle", hint.replace.k_shuffle, layer.gathered_k if layer else None),
            ("v_shuffle", hint.replace.v_shuffle, layer.gathered_v if layer else None),
        ):
            if not shuffle:
                continue
            rank = shapes.rank(tensor) if tensor else None
            expected_len = rank if rank is not None else len(shuffle)
            if not is_permutation(shuffle) or len(shuffle) != expected_len:
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


def _check_scattered_and_gathered(hints: ShardHints, report: Report) -> None:
    outputs = {t.name for t in hints.outputs}
    for tensor in hints.inputs:
        if tensor.name in outputs:
            report.add(
                "SC122",
                ERROR,
                f"inputs[name={tensor.name}]",
                f"{tensor.name!r} is in inputs (scattered) and in outputs (gathered): the shard "
                "would gather it right after scattering it, and what reads it would get the "
                "whole sequence on every rank; keep it in one of them",
                tensor=tensor.name,
                expected="one of inputs, outputs",
                observed="both",
            )


class _Scattered:
    """The tensors computed from the hinted inputs (which are scattered), found when first
    asked about.

    Through Shape too (a length taken from a scattered tensor is a local one), but not past a
    shape-like value that shape inference knows holds none of the scattered axes' symbols: the
    same on every rank (the head size an SDPA scale reads from Q's Shape, the batch size
    latents are expanded by). And an attention layer's output is reached
    only when its Q is: with its K and V gathered, a layer whose queries are whole (Perceiver's
    latents attending to a scattered input) computes a whole output on every rank."""

    def __init__(
        self,
        index: GraphIndex,
        hints: ShardHints,
        shapes: ShapeInference,
        layers: list[AttentionLayer],
    ) -> None:
        self.index = index
        self.shapes = shapes
        self.starts = [t.name for t in hints.inputs]
        self.layer_outputs = {layer.output: layer.q for layer in layers}
        self.symbols = _sequence_symbols(shapes, hints)
        self._reached: set[str] | None = None

    def reaches(self, layer: AttentionLayer) -> bool:
        """Whether the layer's gathered K or V is computed from a scattered tensor."""
        if self._reached is None:
            self._reached = self._walk()
        return layer.gathered_k in self._reached or layer.gathered_v in self._reached

    def _walk(self) -> set[str]:
        layer_outputs = self.layer_outputs
        reached = set(self.starts)
        queue = deque(self.starts)
        waiting: dict[str, list[str]] = {}  # a layer's Q -> its outputs, met before it
        while queue:
            tensor = queue.popleft()
            for output in (*waiting.pop(tensor, ()), *self._next(tensor)):
                if output in reached or self._fixed(output):
                    continue
                q = layer_outputs.get(output)
                if q is not None and q not in reached:
                    waiting.setdefault(q, []).append(output)
                    continue
                reached.add(output)
                queue.append(output)
        return reached

    def _next(self, tensor: str) -> list[str]:
        nodes = self.index.nodes
        return [
            output
            for at in self.index.consumers.get(tensor, ())
            for output in nodes[at].outputs
            if output
        ]

    def _fixed(self, tensor: str) -> bool:
        value = self.shapes.value(tensor)
        if value is None or self.symbols is None:
            return value is not None and all(isinstance(dim, int) for dim in value)
        return all(
            isinstance(dim, int) or self.symbols.isdisjoint(re.findall(r"\w+", str(dim)))
            for dim in value
        )


def _sequence_symbols(shapes: ShapeInference, hints: ShardHints) -> set[str] | None:
    """The symbols of the dims on the hinted inputs' scattered axes; None when one of those
    dims is not a known symbol (then only plain numbers are known to be the same on every
    rank)."""
    symbols: set[str] = set()
    for tensor in hints.inputs:
        shape = shapes.shape(tensor.name)
        axis = tensor.seq_len_idx
        dim = shape[axis] if shape is not None and 0 <= axis < len(shape) else None
        if not isinstance(dim, str):
            return None
        symbols.update(re.findall(r"\w+", dim))
    return symbols


def check_given_rank(
    report: Report, field: str, tensor: ShardTensor, rank: int, *, known_as: str
) -> None:
    """SC104 when ``tensor`` is hinted with a rank other than ``rank``; ``known_as`` says how
    the rank is known (the model declares it, or the runs show it)."""
    if tensor.rank is None or tensor.rank == rank:
        return
    report.add(
        "SC104",
        ERROR,
        f"{field}.rank",
        f"rank {tensor.rank} given for {tensor.name!r}{known_as.format(rank=rank)}",
        tensor=tensor.name,
        expected=rank,
        observed=tensor.rank,
    )
