"""gen: hints from a graph index and options, a pure function (no files, no printing).

The default mode lives here; ``compat.py`` is Polygraphy's mode and ``messages.py`` the words of
the warnings both give."""

from __future__ import annotations

from dataclasses import replace

from shardcheck.analysis.axes import carries_any
from shardcheck.analysis.detect import AttentionLayer, detect_attention, sequence_dims
from shardcheck.analysis.polygraphy import dependent_graph_inputs, dependent_graph_outputs
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.analysis.symbolic import BATCH_LIKE
from shardcheck.errors import AnalysisError, InputError
from shardcheck.frontier.search import find_frontier
from shardcheck.generation import messages
from shardcheck.generation.compat import generate_polygraphy, guess_seq_len_idx_by_name
from shardcheck.generation.extension import extended_plan
from shardcheck.generation.fused import fused_replacements
from shardcheck.generation.inlined import inlined_plan
from shardcheck.generation.options import GenOptions
from shardcheck.generation.parts import GenResult, with_options
from shardcheck.graph.index import GraphIndex, Shape, gc_paused
from shardcheck.hints.model import ShardHints, ShardTensor
from shardcheck.wording import listed


def generate(index: GraphIndex, options: GenOptions) -> GenResult:
    """Build shard hints for ``index``.

    The default mode detects attention as real exporters write it, infers every sequence axis
    from the graph and suggests the CP frontier (``options.io == "frontier"``) or the graph
    inputs and outputs the layers depend on (``"graph"``). ``compat="polygraphy"`` follows
    Polygraphy 0.53.6's shard-hints instead. The output order is fixed (graph order).
    """
    with gc_paused():
        if options.compat == "polygraphy":
            result = generate_polygraphy(index, options)
        else:
            result = generate_detected(index, options)
    extension = result.extension
    inlined = extension is not None and bool(
        extension.hints.lengths and extension.hints.lengths.inlined
    )
    about_options = [*messages.about_options(options), *messages.hidden_layers(index, inlined)]
    if not about_options:
        return result
    return replace(result, warnings=(*result.warnings, *about_options))


def generate_detected(index: GraphIndex, options: GenOptions) -> GenResult:
    """The default mode: attention found by structure, axes inferred, the CP frontier."""
    shapes = ShapeInference(index)
    layers = detect_attention(index, shapes)
    warnings = messages.about_layers(index, layers, options)

    kv_axes = _kv_axes(index, layers, options)
    warnings.extend(messages.overridden_axes(index, layers, options))
    warnings.extend(messages.fixed_length(index, shapes, layers))
    warnings.extend(messages.shapeless_masks(index, shapes, layers))
    warnings.extend(messages.baked_selections(index, shapes))

    inputs: tuple[ShardTensor, ...] = ()
    outputs: tuple[ShardTensor, ...] = ()
    frontier = None
    if not options.no_suggest_io and layers:
        if options.io == "graph":
            inputs, outputs, guessed = _graph_io(index, shapes, layers, options)
            warnings.extend(messages.no_sequence_axis(index, guessed))
        else:
            frontier = find_frontier(index, shapes, layers)
            warnings.extend(
                messages.Warned("SC308", f"{index.source}: {w}") for w in frontier.warnings
            )
            inputs, outputs = tuple(frontier.inputs), tuple(frontier.outputs)
    warnings.extend(messages.unknown_ranks(index, (*inputs, *outputs)))
    replacements = None
    if options.cp_type == "fused":
        replacements, about_fused = fused_replacements(index, shapes, layers, options)
        warnings.extend(about_fused)
    found = ShardHints(inputs=inputs, outputs=outputs, **kv_axes)
    contexts = {layer.q for layer in layers if layer.kv_context}
    hints = with_options(found, options, (layer.q for layer in layers), replacements, contexts)
    extension = None
    declined: list[str] = []
    if options.extension and options.io == "frontier" and not options.no_suggest_io:
        # A graph that calls model-local functions: the plan of the model with them inlined.
        extension = inlined_plan(index, options, hints, declined)
    if frontier is not None and options.extension and extension is None:
        extension = extended_plan(index, shapes, layers, hints, len(frontier.warnings), declined)
    return GenResult(
        hints=hints,
        warnings=tuple(warnings),
        layers=tuple(layers),
        extension=extension,
        no_extension=declined[0] if declined else None,
        shapes=shapes,
    )


def _kv_axes(
    index: GraphIndex, layers: list[AttentionLayer], options: GenOptions
) -> dict[str, int | None]:
    """One K index, one V index and one K/V rank for the whole model (keyed by their fields of
    the hints), or an error that says which layers disagree."""
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
            groups = (
                _rank_groups(layers)
                if field_name == "kv_rank"
                else "; ".join(
                    f"{value} for {', '.join(_layers_with(layers, field_name, value))}"
                    for value in known
                )
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
    return {
        "k_seq_len_idx": 0 if k_idx is None else k_idx,
        "v_seq_len_idx": 0 if v_idx is None else v_idx,
        "kv_rank": kv_rank,
    }


_OPTION_OF = {"k_seq_len_idx": "k-idx", "v_seq_len_idx": "v-idx", "kv_rank": "kv-rank"}


def _layers_with(layers: list[AttentionLayer], field_name: str, value: int) -> list[str]:
    if field_name == "k_seq_len_idx":
        return [layer.name for layer in layers if layer.k_axis == value]
    return [layer.name for layer in layers if layer.v_axis == value]


def _rank_groups(layers: list[AttentionLayer]) -> str:
    """The K/V ranks the layers need, each layer named once: ``3 for a, b; K 3 and V 4 for
    c`` (a layer whose K and V ranks differ is a group of its own kind)."""
    groups: dict[str, list[str]] = {}
    for layer in layers:
        ranks = {rank for rank in (layer.k_rank, layer.v_rank) if rank is not None}
        if not ranks:
            continue
        key = str(ranks.pop()) if len(ranks) == 1 else f"K {layer.k_rank} and V {layer.v_rank}"
        groups.setdefault(key, []).append(layer.name)
    return "; ".join(f"{key} for {', '.join(names)}" for key, names in groups.items())


def _graph_io(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer], options: GenOptions
) -> tuple[tuple[ShardTensor, ...], tuple[ShardTensor, ...], list[str]]:
    """Polygraphy's choice of tensors (graph inputs and outputs), with inferred axes; and
    those none of whose axes carries the sequence (written with the option's index)."""
    ends = [index.nodes[index.producer[layer.output]] for layer in layers]
    sequences = sequence_dims(shapes, layers)
    guessed: list[str] = []

    def tensor(name: str, default_idx: int, default_rank: int | None) -> ShardTensor:
        shape = shapes.shape(name)
        axis = next((i for i, d in enumerate(shape or ()) if carries_any(d, sequences)), None)
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
