"""The words of gen's warnings: what each one says, and when it is due.

Each warning carries a code (``Warned.code``, docs/findings.md): verify's, where verify reports
the same thing (SC110: a layer Polygraphy skips), else one of gen's own SC3nn; ``gen --ignore
CODE`` leaves it out.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardcheck.analysis.baked import baked_lengths
from shardcheck.analysis.detect import AttentionLayer, axis_dim, sequence_dim
from shardcheck.analysis.hidden import describe, hidden_attention, what_to_do
from shardcheck.analysis.selections import baked_counts, describe_baked
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.generation.options import GenOptions
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardTensor, is_permutation
from shardcheck.wording import counted, listed


class Warned(str):
    """A warning's text (it is a ``str``), with its finding code."""

    code: str

    def __new__(cls, code: str, text: str) -> Warned:
        warned = super().__new__(cls, text)
        warned.code = code
        return warned

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]
        # What pickle and copy make it again from (check's worker processes send warnings).
        return (self.code, str(self))


def code_of(warning: str) -> str | None:
    """The code of a warning; None for one made without (every warning should have one)."""
    return warning.code if isinstance(warning, Warned) else None


def about_options(options: GenOptions) -> list[str]:
    """What gen says of the options themselves, in either mode."""
    return [*ignored_options(options), *shuffles_not_permutations(options)]


def hidden_layers(index: GraphIndex, inlined_by_extension: bool = False) -> list[str]:
    """A warning when attention sits where no hint can name it (a subgraph, a function);
    ``inlined_by_extension``: gen writes the extension that inlines the functions."""
    hidden = hidden_attention(index.model)
    if not hidden:
        return []
    then = f"To shard it, {what_to_do(hidden)}"
    if inlined_by_extension:
        then = (
            "The extension gen writes beside them does: 'shardcheck shard' inlines the "
            f"functions first. For hints that shard it alone, {what_to_do(hidden)}"
        )
    return [
        Warned(
            "SC129",
            f"{index.source}: attention that gen does not search, and that no hint can name, "
            f"in {describe(hidden)}; the hints shard none of it. {then}",
        )
    ]


def no_layers_polygraphy(index: GraphIndex, pattern: str) -> str:
    return Warned(
        "SC301",
        f"{index.source}: no attention layer found (tried Polygraphy's {pattern}); the hints "
        "have no layers",
    )


def about_layers(index: GraphIndex, layers: list[AttentionLayer], options: GenOptions) -> list[str]:
    """What the default mode says of the layers it found, or of finding none."""
    warnings: list[str] = []
    if not layers:
        warnings.append(
            Warned(
                "SC301",
                f"{index.source}: no attention layer found (looked for Softmax between two MatMuls "
                "or Einsums, with scales, masks and casts between them, and for fused Attention, "
                "MultiHeadAttention and GroupQueryAttention nodes); the hints have no layers",
            )
        )
    skipped = [layer.name for layer in layers if not layer.polygraphy_recognises]
    if skipped:
        warnings.append(
            Warned(
                "SC110",
                f"{index.source}: {len(skipped)} of {counted(len(layers), 'attention layer')} "
                f"{'matches' if len(skipped) == 1 else 'match'} neither of Polygraphy's patterns "
                f"({'first: ' if len(skipped) > 1 else ''}{skipped[0]}); 'polygraphy "
                f"multi-device shard' would skip {'it' if len(skipped) == 1 else 'them'}, "
                "'shardcheck shard' does not",
            )
        )
    warnings.extend(layer_warnings(index, layers, options))
    unknown = [layer.name for layer in layers if layer.q_axis is None or layer.k_axis is None]
    if unknown:
        warnings.append(
            Warned(
                "SC304",
                f"{index.source}: the ranks of Q/K/V are unknown for layer {unknown[0]}"
                f"{f' and {len(unknown) - 1} more' if len(unknown) > 1 else ''}; "
                "their axes fall back to the --k-idx/--v-idx/--kv-rank options",
            )
        )
    return warnings


def no_sequence_axis(index: GraphIndex, guessed: Sequence[str]) -> list[str]:
    """--io graph: tensors none of whose axes carries the sequence (written with the option's
    axis)."""
    if not guessed:
        return []
    return [
        Warned(
            "SC306",
            f"{index.source}: no axis of {listed(guessed)} carries the sequence: "
            f"{'it is' if len(guessed) == 1 else 'they are'} written with the "
            "--i-idx/--o-idx axis, as Polygraphy writes them, which CP cannot split "
            "along the sequence; the default --io frontier finds the tensors that carry it",
        )
    ]


def unknown_ranks(index: GraphIndex, tensors: Sequence[ShardTensor]) -> list[str]:
    """Hinted tensors whose rank shape inference could not find."""
    rankless = [t.name for t in tensors if t.rank is None]
    if not rankless:
        return []
    return [
        Warned(
            "SC307",
            f"{index.source}: the rank of {counted(len(rankless), 'hinted tensor')} is not "
            f"known ({'first: ' if len(rankless) > 1 else ''}{rankless[0]}): shape inference "
            "could not follow the graph there. Sharding it ('shardcheck shard', verify "
            "--ranks, Polygraphy) needs it: declare its shape in the model's value_info",
        )
    ]


def shuffles_not_permutations(options: GenOptions) -> list[str]:
    """A warning for each fused shuffle that is not a permutation (written as given, as
    Polygraphy writes it; the fused replacement cannot transpose by it)."""
    if options.cp_type != "fused":
        return []
    return [
        Warned(
            "SC112",
            f"--{name.replace('_', '-')} {','.join(map(str, shuffle))} is not a permutation "
            f"(each axis from 0 to {len(shuffle) - 1} once); verify reports it (SC112)",
        )
        for name in ("q_shuffle", "k_shuffle", "v_shuffle")
        if (shuffle := getattr(options, name)) and not is_permutation(shuffle)
    ]


def ignored_options(options: GenOptions) -> list[str]:
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
                Warned(
                    "SC302",
                    f"{listed(fused_only)} {'applies' if len(fused_only) == 1 else 'apply'} to "
                    "--cp-type fused only; ignored",
                )
            )
    if options.compat == "none" and options.attention_pattern != 0:
        warnings.append(
            Warned(
                "SC302",
                "--attention-pattern chooses a Polygraphy pattern, for --compat polygraphy only; "
                "ignored (shardcheck detects attention as exporters write it)",
            )
        )
    if options.parallelism != "CP":
        warnings.append(
            Warned(
                "SC302",
                f"--parallelism {options.parallelism} changes only the hints' label (they are "
                "built as for CP, as Polygraphy builds them); 'shardcheck shard' and 'verify "
                "--ranks' take CP hints only",
            )
        )
    if options.io == "graph" and (options.compat == "polygraphy" or options.no_suggest_io):
        why = "--compat polygraphy" if options.compat == "polygraphy" else "--no-suggest-io"
        warnings.append(Warned("SC302", f"--io graph changes nothing with {why}; ignored"))
    return warnings


def fixed_length(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer]
) -> list[str]:
    """A warning when the model runs at one sequence length only: its query axis is a fixed
    size, or a Reshape holds the traced length."""
    if not layers:
        return []
    seq = sequence_dim(shapes, layers)
    if isinstance(seq, int):
        return [
            Warned(
                "SC120",
                f"{index.source}: the sequence length is fixed at {seq} in this model (the query "
                f"axis of layer {layers[0].name} has that size, not a symbolic dim), so the "
                "sequence axes are found by size and CP works at that length only if no rank's "
                "slice reaches a node that holds it (a Reshape to a fixed shape). If the export "
                "fixed it, export with a dynamic sequence axis; check CP with 'shardcheck verify "
                f"{index.source} HINTS --ranks N'",
            )
        ]
    baked = baked_lengths(index, shapes, seq)
    if not baked:
        return []
    node, length = baked[0]
    more = f" (and {counted(len(baked) - 1, 'other Reshape')})" if len(baked) > 1 else ""
    # An encoder-decoder traced with a target length of its own has that one baked too.
    own = [
        (dim, found[0][1])
        for dim in dict.fromkeys(axis_dim(shapes, layer.q, layer.q_axis) for layer in layers)
        if dim != seq and (found := baked_lengths(index, shapes, dim))
    ]
    also = "".join(f" (and its {dim} dim one of {n})" for dim, n in own)
    own_lengths = "".join(f" --seq-len {dim}={n},{2 * n}" for dim, n in own)
    return [
        Warned(
            "SC002",
            f"{index.source}: the sequence length is baked into the model: {node.label}{more} "
            f"reshapes to a fixed shape that holds a length of {length}{also}, so the model runs "
            "at that length only (TorchScript's tracing writes it there; PyTorch's dynamo "
            "exporter keeps it symbolic). Polygraphy's shard splits it at that length only if "
            "no rank's slice reaches those nodes; the extension gen writes beside the hints, "
            "where it can, makes each of them read the length from its input: check with "
            f"'shardcheck verify {index.source} HINTS --ranks N "
            f"--seq-lens {length},{2 * length}{own_lengths}'",
        )
    ]


def baked_selections(index: GraphIndex, shapes: ShapeInference) -> list[str]:
    """SC003 where a trace fixed how many entries a NonZero lists (selections.py)."""
    found = baked_counts(shapes)
    if not found:
        return []
    return [Warned("SC003", f"{index.source}: {describe_baked(shapes, found)}")]


def shapeless_masks(
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
        Warned(
            "SC305",
            f"{index.source}: the shape of {mask}{more}, which layer {layer.name} combines with "
            "its scores, is not fully known (shape inference could not follow the graph there), "
            "so gen cannot tell whether each rank needs a slice of it; CP may not be exact: "
            f"check with 'shardcheck verify {index.source} HINTS --ranks N'",
        )
    ]


def layer_warnings(
    index: GraphIndex, layers: list[AttentionLayer], options: GenOptions
) -> list[str]:
    """What keeps the layers from sharding as the hints say: Q, K and V computed from one
    input; a fused attention told a causality its mask does not have."""
    warnings: list[str] = []
    packed = [layer.name for layer in layers if layer.packed]
    if packed:
        one = len(packed) == 1
        warnings.append(
            Warned(
                "SC303",
                f"{index.source}: {counted(len(packed), 'attention layer')} "
                f"({'first: ' if not one else ''}{packed[0]}) {'takes' if one else 'take'} Q and K "
                "from one tensor: gathering K and V gathers Q too, so every rank computes "
                f"{'it' if one else 'them'} whole, which CP does not speed up (a packed "
                "com.microsoft Attention, as onnxruntime's transformer optimizer fuses it, does "
                "so: shard the model before that fusion)",
            )
        )
    if options.cp_type == "fused" and options.is_causal:
        # Each layer's is_causal is inferred from its mask; --is-causal sets it on every one.
        unlike = [layer.name for layer in layers if (layer.causal is not None) != options.is_causal]
        if unlike:
            warnings.append(
                Warned(
                    "SC124",
                    f"{index.source}: the fused attention is told is_causal "
                    f"{str(options.is_causal).lower()} for every layer, but the mask of "
                    f"{counted(len(unlike), 'layer')} ({'first: ' if len(unlike) > 1 else ''}"
                    f"{unlike[0]}) is {'not ' if options.is_causal else ''}causal; verify reports "
                    "it (SC124)",
                )
            )
    return warnings


def overridden_axes(
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
                Warned(
                    "SC105" if option == "--k-idx" else "SC106",
                    f"{index.source}: {option} {given} is written, but "
                    f"{counted(len(unlike), 'layer')} {'carries' if len(unlike) == 1 else 'carry'} "
                    f"the keys on another axis ({'first: ' if len(unlike) > 1 else ''}{name}, "
                    f"axis {axis}); verify reports it",
                )
            )
    return warnings
