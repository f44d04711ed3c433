"""Hints from a graph index and options: a pure function, no files, no printing."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shardcheck.analysis.axes import carries
from shardcheck.analysis.baked import baked_lengths
from shardcheck.analysis.detect import AttentionLayer, detect_attention, sequence_dim
from shardcheck.analysis.polygraphy import PATTERN_DESCRIPTIONS, PatternMatch, match_all
from shardcheck.analysis.polygraphy_walk import dependent_graph_inputs, dependent_graph_outputs
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.errors import AnalysisError, InputError, ModelError
from shardcheck.frontier.search import find_frontier
from shardcheck.generation.options import GenOptions
from shardcheck.graph.index import GraphIndex, Shape, gc_paused
from shardcheck.hints.model import (
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
    ShardTensor,
    is_permutation,
)
from shardcheck.wording import counted, listed

# Polygraphy's whole idea of a sequence axis: a dim with one of these names.
POLYGRAPHY_SEQ_DIM_NAMES = ("sequence_length", "seq_len")


@dataclass(frozen=True)
class GenResult:
    hints: ShardHints
    warnings: tuple[str, ...] = field(default=())
    layers: tuple[AttentionLayer, ...] = field(default=())


def generate(index: GraphIndex, options: GenOptions) -> GenResult:
    """Build shard hints for ``index``.

    The default mode detects attention as real exporters write it, infers every sequence axis
    from the graph and suggests the CP frontier (``options.io == "frontier"``) or the graph
    inputs and outputs the layers depend on (``"graph"``). ``compat="polygraphy"`` follows
    Polygraphy 0.53.6's shard-hints instead. The output order is fixed (graph order).
    """
    with gc_paused():
        if options.compat == "polygraphy":
            result = _generate_polygraphy(index, options)
        else:
            result = _generate_detected(index, options)
    about_options = [*_ignored_options(options), *_shuffles_not_permutations(options)]
    if not about_options:
        return result
    return GenResult(result.hints, (*result.warnings, *about_options), result.layers)


def _shuffles_not_permutations(options: GenOptions) -> list[str]:
    """A warning for each fused shuffle that is not a permutation (written as given, as
    Polygraphy writes it; the fused replacement cannot transpose by it)."""
    if options.cp_type != "fused":
        return []
    return [
        f"--{name.replace('_', '-')} {','.join(map(str, shuffle))} is not a permutation "
        f"(each axis from 0 to {len(shuffle) - 1} once); verify reports it (SC112)"
        for name in ("q_shuffle", "k_shuffle", "v_shuffle")
        if (shuffle := getattr(options, name)) and not is_permutation(shuffle)
    ]


def _ignored_options(options: GenOptions) -> list[str]:
    """Warnings for options given values that change nothing in this mode (Polygraphy ignores
    them silently; the hints are the same as without them)."""
    warnings = []
    if options.cp_type == "native":
        fused_only = [
            f"--{name.replace('_', '-')}"
            for name in ("q_shuffle", "k_shuffle", "v_shuffle")
            if getattr(options, name) is not None
        ] + (["--is-causal"] if options.is_causal else [])
        if fused_only:
            warnings.append(
                f"{listed(fused_only)} {'applies' if len(fused_only) == 1 else 'apply'} to "
                "--cp-type fused only; ignored"
            )
    if options.compat == "none" and options.attention_pattern != 0:
        warnings.append(
            "--attention-pattern chooses a Polygraphy pattern, for --compat polygraphy only; "
            "ignored (shardcheck detects attention as exporters write it)"
        )
    if options.parallelism != "CP":
        warnings.append(
            f"--parallelism {options.parallelism} changes only the hints' label (they are built "
            "as for CP, as Polygraphy builds them); 'shardcheck shard' and 'verify --ranks' "
            "take CP hints only"
        )
    if options.io == "graph" and (options.compat == "polygraphy" or options.no_suggest_io):
        why = "--compat polygraphy" if options.compat == "polygraphy" else "--no-suggest-io"
        warnings.append(f"--io graph changes nothing with {why}; ignored")
    return warnings


def _collectives(options: GenOptions) -> DistCollective:
    return DistCollective(
        group_size=options.gpus,
        root=options.root,
        nb_rank=options.nb_rank,
        groups=tuple(options.groups),
        reduce_op=options.reduce_op,
    )


def _layer_hint(q: str, options: GenOptions) -> AttentionLayerHint:
    return AttentionLayerHint(
        q=q,
        gather_kv=options.cp_type == "native",
        gather_q=False,
        replace=_fused(options) if options.cp_type == "fused" else None,
    )


def _generate_polygraphy(index: GraphIndex, options: GenOptions) -> GenResult:
    _require_unique_names_for_polygraphy(index)
    matches = match_all(index, options.attention_pattern)
    warnings: list[str] = []
    if not matches:
        warnings.append(
            f"{index.source}: no attention layer found (tried Polygraphy's "
            f"{PATTERN_DESCRIPTIONS[options.attention_pattern]}); the hints have no layers"
        )
    inputs: tuple[ShardTensor, ...] = ()
    outputs: tuple[ShardTensor, ...] = ()
    if not options.no_suggest_io:
        ends = [m.matmul2 for m in matches]
        inputs = tuple(
            _polygraphy_shard_tensor(index, name, options.i_idx, options.i_rank)
            for name in dependent_graph_inputs(index, ends)
        )
        outputs = tuple(
            _polygraphy_shard_tensor(index, name, options.o_idx, options.o_rank)
            for name in dependent_graph_outputs(index, ends)
        )
    hints = ShardHints(
        parallelism=options.parallelism,
        attention_layers=tuple(_layer_hint(match.q, options) for match in matches),
        dist_collectives=_collectives(options),
        inputs=inputs,
        outputs=outputs,
        k_seq_len_idx=0 if options.k_idx is None else options.k_idx,
        v_seq_len_idx=0 if options.v_idx is None else options.v_idx,
        kv_rank=_polygraphy_kv_rank(index, matches, options.kv_rank),
    )
    return GenResult(hints=hints, warnings=tuple(warnings))


def _generate_detected(index: GraphIndex, options: GenOptions) -> GenResult:
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    warnings: list[str] = []
    if not layers:
        warnings.append(
            f"{index.source}: no attention layer found (looked for Softmax between two MatMuls "
            "or Einsums, with scales, masks and casts between them, and for fused Attention, "
            "MultiHeadAttention and GroupQueryAttention nodes); the hints have no layers"
        )
    skipped = [layer.name for layer in layers if not layer.polygraphy_recognises]
    if skipped:
        warnings.append(
            f"{index.source}: {len(skipped)} of {counted(len(layers), 'attention layer')} "
            f"{'matches' if len(skipped) == 1 else 'match'} neither of Polygraphy's patterns "
            f"({'first: ' if len(skipped) > 1 else ''}{skipped[0]}); 'polygraphy "
            f"multi-device shard' would skip {'it' if len(skipped) == 1 else 'them'}, "
            "'shardcheck shard' does not"
        )
    warnings.extend(_layer_warnings(index, layers, options))
    unknown = [layer.name for layer in layers if layer.q_axis is None or layer.k_axis is None]
    if unknown:
        warnings.append(
            f"{index.source}: the ranks of Q/K/V are unknown for layer {unknown[0]}"
            f"{f' and {len(unknown) - 1} more' if len(unknown) > 1 else ''}; "
            "their axes fall back to the --k-idx/--v-idx/--kv-rank options"
        )
    k_idx, v_idx, kv_rank = _kv_axes(index, layers, options)
    warnings.extend(_overridden_axes(index, layers, options))
    warnings.extend(_fixed_length_warning(index, shapes, layers))
    warnings.extend(_shapeless_mask_warning(index, shapes, layers))

    inputs: tuple[ShardTensor, ...] = ()
    outputs: tuple[ShardTensor, ...] = ()
    if not options.no_suggest_io and layers:
        if options.io == "graph":
            inputs, outputs, guessed = _graph_io(index, shapes, layers, options)
            if guessed:
                warnings.append(
                    f"{index.source}: no axis of {listed(guessed)} carries the sequence: "
                    f"{'it is' if len(guessed) == 1 else 'they are'} written with the "
                    "--i-idx/--o-idx axis, as Polygraphy writes them, which CP cannot split "
                    "along the sequence; the default --io frontier finds the tensors that carry it"
                )
        else:
            frontier = find_frontier(index, shapes, layers)
            warnings.extend(f"{index.source}: {w}" for w in frontier.warnings)
            inputs = tuple(ShardTensor(t.name, t.axis, t.rank) for t in frontier.inputs)
            outputs = tuple(ShardTensor(t.name, t.axis, t.rank) for t in frontier.outputs)
    rankless = [t.name for t in (*inputs, *outputs) if t.rank is None]
    if rankless:
        warnings.append(
            f"{index.source}: the rank of {counted(len(rankless), 'hinted tensor')} is not "
            f"known ({'first: ' if len(rankless) > 1 else ''}{rankless[0]}): shape inference "
            "could not follow the graph there. Sharding it ('shardcheck shard', verify "
            "--ranks, Polygraphy) needs it: declare its shape in the model's value_info"
        )
    hints = ShardHints(
        parallelism=options.parallelism,
        attention_layers=tuple(_layer_hint(layer.q, options) for layer in layers),
        dist_collectives=_collectives(options),
        inputs=inputs,
        outputs=outputs,
        k_seq_len_idx=k_idx,
        v_seq_len_idx=v_idx,
        kv_rank=kv_rank,
    )
    return GenResult(hints=hints, warnings=tuple(warnings), layers=tuple(layers))


def _fixed_length_warning(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> list[str]:
    """A warning when the model runs at one sequence length only: its query axis is a fixed
    size, or a Reshape holds the traced length."""
    if not layers:
        return []
    seq = sequence_dim(shapes, layers)
    if isinstance(seq, int):
        return [
            f"{index.source}: the sequence length is fixed at {seq} in this model (the query "
            f"axis of layer {layers[0].name} has that size, not a symbolic dim), so the "
            "sequence axes are found by size and CP works at that length only if no rank's "
            "slice reaches a node that holds it (a Reshape to a fixed shape). If the export "
            "fixed it, export with a dynamic sequence axis; check CP with 'shardcheck verify "
            f"{index.source} HINTS --ranks N'"
        ]
    baked = baked_lengths(index, shapes, seq)
    if not baked:
        return []
    node, length = baked[0]
    more = f" (and {counted(len(baked) - 1, 'other Reshape')})" if len(baked) > 1 else ""
    return [
        f"{index.source}: the sequence length is baked into the model: {node.label}{more} "
        f"reshapes to a fixed shape that holds a length of {length}, so the model runs at that "
        "length only (TorchScript's tracing writes it there; PyTorch's dynamo exporter keeps "
        "it symbolic). CP shards it at that length only if no rank's slice reaches those "
        f"nodes: check with 'shardcheck verify {index.source} HINTS --ranks N --seq-lens "
        f"{length},{2 * length}'"
    ]


def _shapeless_mask_warning(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> list[str]:
    """A warning for masks whose shape is not fully known: the frontier cannot tell whether
    they carry the queries. A mask serving several layers (XLNet's) is named once."""
    shapeless: dict[str, AttentionLayer] = {}
    for layer in layers:
        for mask in layer.masks:
            if None in (shapes.shape(mask) or (None,)):
                shapeless.setdefault(mask, layer)
    if not shapeless:
        return []
    mask, layer = next(iter(shapeless.items()))
    more = f" (and {len(shapeless) - 1} more)" if len(shapeless) > 1 else ""
    return [
        f"{index.source}: the shape of {mask}{more}, which layer {layer.name} combines with "
        "its scores, is not fully known (shape inference could not follow the graph there), "
        "so gen cannot tell whether each rank needs a slice of it; CP may not be exact: "
        f"check with 'shardcheck verify {index.source} HINTS --ranks N'"
    ]


def _kv_axes(
    index: GraphIndex, layers: list[AttentionLayer], options: GenOptions
) -> tuple[int, int, int | None]:
    """One K index, one V index and one K/V rank for the whole model, or an error that says
    which layers disagree."""
    chosen: list[int | None] = []
    conflicts: list[tuple[str, str]] = []  # field, the values the layers need
    for field_name, explicit, values in (
        ("k_seq_len_idx", options.k_idx, [layer.k_axis for layer in layers]),
        ("v_seq_len_idx", options.v_idx, [layer.v_axis for layer in layers]),
        (
            "kv_rank",
            options.kv_rank,
            [layer.k_rank for layer in layers] + [layer.v_rank for layer in layers],
        ),
    ):
        if explicit is not None:
            chosen.append(explicit)
            continue
        known = sorted({v for v in values if v is not None})
        if len(known) > 1:
            groups = "; ".join(
                f"{value} for {', '.join(_layers_with(layers, field_name, value))}"
                for value in known
            )
            conflicts.append((field_name, groups))
        chosen.append(known[0] if known else None)
    if conflicts:
        # Every field at once: one run tells all the options that are needed.
        needed = listed([f"{name} ({groups})" for name, groups in conflicts])
        to_pass = listed([f"--{_OPTION_OF[name]}" for name, _ in conflicts])
        raise AnalysisError(
            f"{index.source}: the attention layers need different values of {needed}; a hints "
            "file holds one of each for the whole model. Nothing was written; pass the values "
            f"to use ({to_pass}) to write it anyway"
        )
    k_idx, v_idx, kv_rank = chosen
    for option, axis in (("--k-idx", options.k_idx), ("--v-idx", options.v_idx)):
        if axis is not None and kv_rank is not None and axis >= kv_rank:
            raise InputError(
                f"{index.source}: {option} {axis}: past the rank of the gathered K and V "
                f"({kv_rank}); the axes are 0 to {kv_rank - 1}"
            )
    return (0 if k_idx is None else k_idx, 0 if v_idx is None else v_idx, kv_rank)


def _layer_warnings(
    index: GraphIndex, layers: list[AttentionLayer], options: GenOptions
) -> list[str]:
    """What keeps the layers from sharding as the hints say: Q, K and V computed from one
    input; a fused attention told a causality its mask does not have."""
    warnings: list[str] = []
    packed = [layer.name for layer in layers if layer.q == layer.gathered_k]
    if packed:
        one = len(packed) == 1
        warnings.append(
            f"{index.source}: {counted(len(packed), 'attention layer')} "
            f"({'first: ' if not one else ''}{packed[0]}) {'takes' if one else 'take'} Q and K "
            "from one tensor: gathering K and V gathers Q too, so every rank computes "
            f"{'it' if one else 'them'} whole, which CP does not speed up (a packed "
            "com.microsoft Attention, as onnxruntime's transformer optimizer fuses it, does "
            "so: shard the model before that fusion)"
        )
    if options.cp_type == "fused":
        # Polygraphy's format gives every layer the one --is-causal.
        unlike = [layer.name for layer in layers if (layer.causal is not None) != options.is_causal]
        if unlike:
            warnings.append(
                f"{index.source}: the fused attention is told is_causal "
                f"{str(options.is_causal).lower()} for every layer, but the mask of "
                f"{counted(len(unlike), 'layer')} ({'first: ' if len(unlike) > 1 else ''}"
                f"{unlike[0]}) is {'not ' if options.is_causal else ''}causal; verify reports "
                "it (SC124)"
            )
    return warnings


def _overridden_axes(
    index: GraphIndex, layers: list[AttentionLayer], options: GenOptions
) -> list[str]:
    """A warning for each --k-idx/--v-idx that differs from the axis a layer's gathered K or V
    carries the keys on (what verify reports as SC105/SC106)."""
    warnings = []
    for option, given, axis_of in (
        ("--k-idx", options.k_idx, lambda layer: layer.k_axis),
        ("--v-idx", options.v_idx, lambda layer: layer.v_axis),
    ):
        if given is None:
            continue
        unlike = [
            (layer.name, axis_of(layer)) for layer in layers if axis_of(layer) not in (None, given)
        ]
        if unlike:
            name, axis = unlike[0]
            warnings.append(
                f"{index.source}: {option} {given} is written, but "
                f"{counted(len(unlike), 'layer')} {'carries' if len(unlike) == 1 else 'carry'} "
                f"the keys on another axis ({'first: ' if len(unlike) > 1 else ''}{name}, "
                f"axis {axis}); verify reports it"
            )
    return warnings


_OPTION_OF = {"k_seq_len_idx": "k-idx", "v_seq_len_idx": "v-idx", "kv_rank": "kv-rank"}


def _layers_with(layers: list[AttentionLayer], field_name: str, value: int) -> list[str]:
    if field_name == "k_seq_len_idx":
        return [layer.name for layer in layers if layer.k_axis == value]
    if field_name == "v_seq_len_idx":
        return [layer.name for layer in layers if layer.v_axis == value]
    return [layer.name for layer in layers if value in (layer.k_rank, layer.v_rank)]


def _graph_io(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer], options: GenOptions
) -> tuple[tuple[ShardTensor, ...], tuple[ShardTensor, ...], list[str]]:
    """Polygraphy's choice of tensors (graph inputs and outputs), with inferred axes; and
    those none of whose axes carries the sequence (written with the option's index)."""
    ends = [index.nodes[index.producer[layer.output]] for layer in layers]
    seq = sequence_dim(shapes, layers)
    guessed: list[str] = []

    def tensor(name: str, default_idx: int, default_rank: int | None) -> ShardTensor:
        shape = shapes.shape(name)
        axis = next((i for i, d in enumerate(shape or ()) if carries(d, seq)), None)
        if axis is None:
            axis = _only_symbolic_axis(shape)
        if axis is None:
            axis = guess_seq_len_idx_by_name(shape, -1)
        if axis < 0:
            axis = default_idx
            guessed.append(name)
        return ShardTensor(name, axis, len(shape) if shape is not None else default_rank)

    inputs = tuple(
        tensor(name, options.i_idx, options.i_rank) for name in dependent_graph_inputs(index, ends)
    )
    outputs = tuple(
        tensor(name, options.o_idx, options.o_rank) for name in dependent_graph_outputs(index, ends)
    )
    return inputs, outputs, guessed


def _only_symbolic_axis(shape: Shape | None) -> int | None:
    """The one axis with a symbolic dim that is not a batch, if there is one: where the
    query axis has a fixed size (Whisper's positions, 8), its input's frames still vary."""
    axes = [
        axis
        for axis, dim in enumerate(shape or ())
        if isinstance(dim, str) and not BATCH_LIKE.search(dim)
    ]
    return axes[0] if len(axes) == 1 else None


def _fused(options: GenOptions) -> FusedAttention:
    return FusedAttention(
        is_causal=options.is_causal,
        q_shuffle=options.q_shuffle,
        k_shuffle=options.k_shuffle,
        v_shuffle=options.v_shuffle,
        nb_rank=options.nb_rank,
    )


def _rank_or(shape: Shape | None, default: int | None) -> int | None:
    # Polygraphy tests the shape for truth: an unknown shape and a scalar both take the default.
    return len(shape) if shape else default


def guess_seq_len_idx_by_name(shape: Shape | None, default: int) -> int:
    for axis, dim in enumerate(shape or ()):
        if dim in POLYGRAPHY_SEQ_DIM_NAMES:
            return axis
    return default


def _polygraphy_shard_tensor(
    index: GraphIndex, name: str, default_idx: int, default_rank: int | None
) -> ShardTensor:
    shape = index.declared_shape(name)
    return ShardTensor(
        name=name,
        seq_len_idx=guess_seq_len_idx_by_name(shape, default_idx),
        rank=_rank_or(shape, default_rank),
    )


def _polygraphy_kv_rank(
    index: GraphIndex, matches: list[PatternMatch], fallback: int | None
) -> int | None:
    kv_rank: int | None = None
    for match in matches:
        if kv_rank:
            break
        k_shape = index.declared_shape(match.k)
        shape = k_shape if k_shape else index.declared_shape(match.v)
        kv_rank = _rank_or(shape, fallback)
    return kv_rank if kv_rank else fallback


def _require_unique_names_for_polygraphy(index: GraphIndex) -> None:
    unnamed = Counter(node.name for node in index.nodes)[""]
    if unnamed > 1:
        raise ModelError(
            f"{index.source}: {unnamed} nodes have no name; Polygraphy's shard-hints needs unique "
            "node names (name the nodes, or run without --compat polygraphy)"
        )
