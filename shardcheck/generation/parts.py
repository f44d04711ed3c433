"""What both of gen's modes build alike: the result, and the hints around what each mode finds
(the collectives, each layer's hint and the fused replacement come from the options alone)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from shardcheck.analysis.detect import AttentionLayer
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.generation.extension import Extended
from shardcheck.generation.options import GenOptions
from shardcheck.hints.model import (
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
)


@dataclass(frozen=True)
class GenResult:
    hints: ShardHints
    warnings: tuple[str, ...] = field(default=())
    layers: tuple[AttentionLayer, ...] = field(default=())
    # The extension's plan, where it splits more than the hints (generation/extension.py).
    extension: Extended | None = None
    # Why gen writes no extension where its cut was declined as not exact (else None).
    no_extension: str | None = None
    # The model's shapes, as the default mode inferred them (None in Polygraphy's): what
    # gen's line of the plan is counted from after.
    shapes: ShapeInference | None = field(default=None, repr=False, compare=False)


def with_options(
    hints: ShardHints,
    options: GenOptions,
    queries: Iterable[str],
    replacements: Mapping[str, FusedAttention | None] | None = None,
    whole_kv: Collection[str] = (),
) -> ShardHints:
    """``hints`` (the tensors and K/V axes a mode found) with what the options set: the
    parallelism, the collectives, and a hint for each layer of ``queries``, in that order.
    ``replacements``: each layer's own fused replacement (None: native), inferred; without,
    the options' one for every layer. ``whole_kv``: the queries of layers whose K and V every
    rank holds whole (a context's): native, nothing gathered."""
    return hints.with_changes(
        parallelism=options.parallelism,
        attention_layers=tuple(
            AttentionLayerHint(q=q, gather_kv=False, gather_q=False, replace=None)
            if q in whole_kv
            else _layer_hint(q, options, replacements)
            for q in queries
        ),
        dist_collectives=_collectives(options),
    )


def _collectives(options: GenOptions) -> DistCollective:
    return DistCollective(
        group_size=options.gpus,
        root=options.root,
        nb_rank=options.nb_rank,
        groups=tuple(options.groups),
        reduce_op=options.reduce_op,
    )


def _layer_hint(
    q: str, options: GenOptions, replacements: Mapping[str, FusedAttention | None] | None
) -> AttentionLayerHint:
    if replacements is not None and q in replacements:
        fused = replacements[q]
        return AttentionLayerHint(q=q, gather_kv=fused is None, gather_q=False, replace=fused)
    return AttentionLayerHint(
        q=q,
        gather_kv=options.cp_type == "native",
        gather_q=False,
        replace=_fused_replacement(options) if options.cp_type == "fused" else None,
    )


def _fused_replacement(options: GenOptions) -> FusedAttention:
    return FusedAttention(
        is_causal=options.is_causal,
        q_shuffle=options.q_shuffle,
        k_shuffle=options.k_shuffle,
        v_shuffle=options.v_shuffle,
        nb_rank=options.nb_rank,
    )
