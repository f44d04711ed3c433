"""verify's static checks of fused replacements (``replace``): each hinted layer's shuffles,
mask and scale against the layer itself (``analysis.fusion``), its ``nb_rank`` against the ranks.

``is_causal`` against the layer's mask is SC124 (static_checks.py); here:

- SC112: a shuffle that is a permutation, but not the one that brings the layer's tensor to
  ``[batch, heads, seq, head_dim]`` (none given: the tensor as it is);
- SC126: ``nb_rank`` unlike the ranks (``--ranks``) or, without them, unlike the collectives';
- SC127: the scale the layer applies is not 1.0, which Polygraphy's fused replacement writes;
- SC128: the layer has a mask that the mask-less fused op would drop (a padding mask).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.fusion import (
    POLYGRAPHY_SCALE,
    FusedSite,
    drops_mask,
    expected_shuffles,
    fused_site,
    shuffled,
)
from shardcheck.analysis.polygraphy import PatternMatch
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import FusedAttention, ShardHints
from shardcheck.verification.findings import ERROR, WARNING, Report

SHUFFLES = ("q_shuffle", "k_shuffle", "v_shuffle")


def check_fused(
    index: GraphIndex,
    shapes: ShapeInference,
    hints: ShardHints,
    by_q: dict[str, AttentionLayer],
    report: Report,
    ranks: int | None = None,
    pattern1: Mapping[str, tuple[AttentionLayer, PatternMatch]] | None = None,
) -> None:
    """Add the findings of every hinted layer with ``replace`` to ``report``; ``pattern1``:
    the hints' Qs that name a layer as Polygraphy's pattern 1 does, with the match."""
    for hint in hints.attention_layers:
        layer = by_q.get(hint.q)
        if hint.replace is None or layer is None:
            continue
        field = f"attention_layers[q={hint.q}].replace"
        _check_nb_rank(hints, hint.replace, field, report, ranks)
        match = (pattern1 or {}).get(hint.q, (None, None))[1]
        site = fused_site(index, layer, match)
        if site.problem:
            continue  # shard refuses it, naming why: SC203 with --ranks
        _check_shuffles(shapes, layer, hint.replace, field, report, site)
        if drops_mask(index, layer):
            report.add(
                "SC128",
                ERROR,
                field,
                f"layer {layer.name} combines its scores with a mask that is not only causal "
                f"({', '.join(layer.masks)}); the fused attention takes no mask and would drop "
                "it (a padding mask: padded positions attended to); hint the layer native "
                "(replace: null, gather_kv: true)",
                expected="native (replace: null)",
                observed="replaced",
            )
        if site.scale is not None and not math.isclose(site.scale, POLYGRAPHY_SCALE):
            report.add(
                "SC127",
                WARNING,
                field,
                f"layer {layer.name} scales its scores by {site.scale:.6g} inside what the fused "
                "attention replaces; 'polygraphy multi-device shard' writes scale=1.0 and so "
                "changes the result, 'shardcheck shard' writes the layer's scale",
                expected=f"{site.scale:.6g}",
                observed=f"{POLYGRAPHY_SCALE:g} (Polygraphy)",
            )


def _check_nb_rank(
    hints: ShardHints, fused: FusedAttention, field: str, report: Report, ranks: int | None
) -> None:
    expected = ranks if ranks is not None else hints.dist_collectives.nb_rank
    if fused.nb_rank == expected:
        return
    against = (
        f"the {ranks} ranks simulated"
        if ranks is not None
        else f"the collectives' nb_rank ({expected})"
    )
    report.add(
        "SC126",
        ERROR if ranks is not None else WARNING,
        f"{field}.nb_rank",
        f"the fused attention's nb_rank {fused.nb_rank} is unlike {against}: each rank would "
        f"attend its queries to the keys of {fused.nb_rank} rank(s), not of every rank's "
        "slice of the sequence",
        expected=expected,
        observed=fused.nb_rank,
    )


def _check_shuffles(
    shapes: ShapeInference,
    layer: AttentionLayer,
    fused: FusedAttention,
    field: str,
    report: Report,
    site: FusedSite,
) -> None:
    expected = expected_shuffles(shapes, site)
    if expected is None:
        return
    for name, wanted, given, tensor in zip(
        SHUFFLES,
        expected,
        (fused.q_shuffle, fused.k_shuffle, fused.v_shuffle),
        (site.q, site.k, site.v),
        strict=True,
    ):
        if given and len(given) != len(shuffled(wanted)):
            continue  # not a permutation of the axes: static_checks' SC112 says so
        if shuffled(given) == shuffled(wanted):
            continue
        report.add(
            "SC112",
            ERROR,
            f"{field}.{name}",
            f"layer {layer.name}: {name} {list(given) if given else None} does not bring "
            f"{tensor!r} to [batch, heads, seq, head_dim]; {list(shuffled(wanted))} does",
            tensor=tensor,
            expected=list(wanted) if wanted else None,
            observed=list(given) if given else None,
        )
