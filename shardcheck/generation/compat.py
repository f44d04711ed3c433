"""gen --compat polygraphy: Polygraphy 0.53.6's shard-hints, reproduced (its two attention
patterns, its walk to the graph inputs and outputs, its guesses by dim name and its fallbacks)."""

from __future__ import annotations

from collections import Counter

from shardcheck.analysis.polygraphy import (
    PATTERN_DESCRIPTIONS,
    PatternMatch,
    dependent_graph_inputs,
    dependent_graph_outputs,
    match_all,
)
from shardcheck.errors import ModelError
from shardcheck.generation import messages
from shardcheck.generation.options import GenOptions
from shardcheck.generation.parts import GenResult, with_options
from shardcheck.graph.index import GraphIndex, Shape
from shardcheck.hints.model import ShardHints, ShardTensor

# Polygraphy's whole idea of a sequence axis: a dim with one of these names.
POLYGRAPHY_SEQ_DIM_NAMES = ("sequence_length", "seq_len")


def generate_polygraphy(index: GraphIndex, options: GenOptions) -> GenResult:
    _require_unique_names_for_polygraphy(index)
    matches = match_all(index, options.attention_pattern)
    warnings: list[str] = []
    if not matches:
        warnings.append(
            messages.no_layers_polygraphy(index, PATTERN_DESCRIPTIONS[options.attention_pattern])
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
    found = ShardHints(
        inputs=inputs,
        outputs=outputs,
        k_seq_len_idx=0 if options.k_idx is None else options.k_idx,
        v_seq_len_idx=0 if options.v_idx is None else options.v_idx,
        kv_rank=_polygraphy_kv_rank(index, matches, options.kv_rank),
    )
    hints = with_options(found, options, (match.q for match in matches))
    return GenResult(hints=hints, warnings=tuple(warnings))


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
