"""gen's fused replacements (``--cp-type fused``, default mode): each layer's own, inferred.

For each layer, the shuffles that bring its Q, K and V to ``[batch, heads, seq, head_dim]`` and
``is_causal`` from its own mask (``analysis.fusion``). A layer that no mask-less fused op can
stand for (a padding mask, ALiBi, a window; another layout) keeps native CP, with a warning,
unless a shuffle or ``--is-causal`` is given: those apply to every layer, as given, and such a
layer is replaced too (warned of). What is no fused attention at all (an Einsum layer, a fused
node) always stays native. ``--compat polygraphy`` copies the options to every layer instead,
as Polygraphy does.
"""

from __future__ import annotations

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.fusion import fused_layout, fused_site
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.generation.messages import Warned
from shardcheck.generation.options import GenOptions
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import FusedAttention
from shardcheck.wording import counted


def fused_replacements(
    index: GraphIndex, shapes: ShapeInference, layers: list[AttentionLayer], options: GenOptions
) -> tuple[dict[str, FusedAttention | None], list[str]]:
    """Q -> the layer's replacement (None: it stays native), and the warnings."""
    replacements: dict[str, FusedAttention | None] = {}
    native: list[tuple[AttentionLayer, str]] = []
    overridden: list[tuple[AttentionLayer, str]] = []
    # A shuffle or --is-causal given: replace even a layer whose mask or layout is unlike the
    # fused op's, as told (what could not be replaced at all stays native).
    told = options.is_causal or any(
        shuffle is not None for shuffle in (options.q_shuffle, options.k_shuffle, options.v_shuffle)
    )
    for layer in layers:
        if layer.q in replacements:
            continue  # a hint names a Q once; the first layer reading it decides
        layout = fused_layout(index, shapes, layer)
        if layout.problem and (not told or fused_site(index, layer).problem):
            replacements[layer.q] = None
            native.append((layer, layout.problem))
            continue
        if layout.problem:
            overridden.append((layer, layout.problem))
        replacements[layer.q] = FusedAttention(
            is_causal=layout.is_causal or options.is_causal,
            q_shuffle=options.q_shuffle if options.q_shuffle is not None else layout.q_shuffle,
            k_shuffle=options.k_shuffle if options.k_shuffle is not None else layout.k_shuffle,
            v_shuffle=options.v_shuffle if options.v_shuffle is not None else layout.v_shuffle,
            nb_rank=options.nb_rank,
        )
    warnings = []
    if native:
        first, problem = native[0]
        warnings.append(
            Warned(
                "SC309",
                f"{index.source}: {counted(len(native), 'attention layer')} of {len(layers)} "
                f"cannot be replaced by a fused attention and stay native (gather K and V); "
                f"first: {first.name}: {problem}",
            )
        )
    if overridden:
        first, problem = overridden[0]
        warnings.append(
            Warned(
                "SC310",
                f"{index.source}: {counted(len(overridden), 'attention layer')} of {len(layers)} "
                f"replaced as the fused options say, although the first, {first.name}, does not "
                f"fit a fused attention: {problem}; check with 'shardcheck verify "
                f"{index.source} HINTS --ranks N'",
            )
        )
    return replacements, warnings
