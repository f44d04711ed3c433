"""Hints from a graph index and options: a pure function, no files, no printing."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shardcheck.errors import ModelError
from shardcheck.graph import GraphIndex, Shape
from shardcheck.hints import (
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
    ShardTensor,
)
from shardcheck.options import GenOptions
from shardcheck.patterns.polygraphy import PATTERN_DESCRIPTIONS, PatternMatch, match_all
from shardcheck.suggest import dependent_graph_inputs, dependent_graph_outputs

# Polygraphy's whole idea of a sequence axis: a dim with one of these names.
POLYGRAPHY_SEQ_DIM_NAMES = ("sequence_length", "seq_len")


@dataclass(frozen=True)
class GenResult:
    hints: ShardHints
    warnings: tuple[str, ...] = field(default=())


def generate(index: GraphIndex, options: GenOptions) -> GenResult:
    """Build shard hints for ``index``.

    Both modes currently follow Polygraphy 0.53.6's shard-hints: its attention patterns, its
    dependency walk for suggested tensors, its name-based sequence-axis guess and its rank
    fallbacks. The output order is fixed (graph order), unlike Polygraphy's.
    """
    if options.compat == "polygraphy":
        _require_unique_names_for_polygraphy(index)
    matches = match_all(index, options.attention_pattern)
    warnings: list[str] = []
    if not matches:
        warnings.append(
            f"{index.source}: no attention layer found (tried Polygraphy's "
            f"{PATTERN_DESCRIPTIONS[options.attention_pattern]}); the hints have no layers"
        )

    layers = tuple(
        AttentionLayerHint(
            q=match.q,
            gather_kv=options.cp_type == "native",
            gather_q=False,
            replace=_fused(options) if options.cp_type == "fused" else None,
        )
        for match in matches
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
        attention_layers=layers,
        dist_collectives=DistCollective(
            group_size=options.gpus,
            root=options.root,
            nb_rank=options.nb_rank,
            groups=tuple(options.groups),
            reduce_op=options.reduce_op,
        ),
        inputs=inputs,
        outputs=outputs,
        k_seq_len_idx=options.k_idx,
        v_seq_len_idx=options.v_idx,
        kv_rank=_polygraphy_kv_rank(index, matches, options.kv_rank),
    )
    return GenResult(hints=hints, warnings=tuple(warnings))


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
