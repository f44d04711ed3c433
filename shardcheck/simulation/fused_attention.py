"""TensorRT's multi-device ``Attention`` (a fused replacement, ``nb_rank``), run in numpy with
its context-parallel meaning, between the stages like a collective.

Each rank holds its slices of Q, K and V, ``[batch, heads, seq, head_dim]`` (K and V may have
fewer heads: grouped KV, each serving ``heads / kv_heads`` query heads). The ranks form groups
of ``nb_rank`` consecutive ranks; within its group, a rank attends its local queries to the
keys and values of every rank of the group, gathered in rank order inside the op. With
``is_causal``, rank r's query i is at global position ``r * S_local + i`` (r its place in the
group) and sees the keys up to that position. ``nb_rank = 1`` is plain fused attention over the
rank's own positions: on one rank, the subgraph it replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from shardcheck.simulation.rank_values import RankFailure, RankValues


@dataclass(frozen=True)
class FusedAttentionStep:
    """A fused multi-device Attention of the plan."""

    node: onnx.NodeProto
    is_causal: bool
    scale: float | None
    nb_rank: int


def fused_attention_step(node: onnx.NodeProto) -> FusedAttentionStep:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    scale = attributes.get("scale")
    return FusedAttentionStep(
        node,
        is_causal=bool(attributes.get("is_causal", 0)),
        scale=None if scale is None else float(scale),
        nb_rank=int(attributes.get("nb_rank", 1)),
    )


def run_fused_attention(step: FusedAttentionStep, values: RankValues, ranks: int) -> None:
    """Every rank's output of ``step``, from every rank's Q, K and V in ``values``."""
    name = step.node.name
    if len(step.node.input) < 3 or len(step.node.output) < 1:
        raise RankFailure(0, name, "a fused Attention reads Q, K and V and makes one output")
    if step.nb_rank < 1 or ranks % step.nb_rank:
        raise RankFailure(
            0, name, f"nb_rank {step.nb_rank} does not divide the {ranks} ranks into groups"
        )
    q_name, k_name, v_name = step.node.input[:3]
    for rank, rank_values in enumerate(values.per_rank):
        missing = [t for t in (q_name, k_name, v_name) if t not in rank_values]
        if missing:
            raise RankFailure(rank, name, f"no value of {missing[0]!r}")
    for rank in range(ranks):
        first = rank - rank % step.nb_rank
        group = range(first, first + step.nb_rank)
        q = values.per_rank[rank][q_name]
        try:
            k = np.concatenate([values.per_rank[r][k_name] for r in group], axis=2)
            v = np.concatenate([values.per_rank[r][v_name] for r in group], axis=2)
            out = _attention(q, k, v, step, offset=(rank - first) * q.shape[2])
        except (ValueError, IndexError) as error:
            raise RankFailure(rank, name, f"fused Attention: {error}") from None
        values.set_rank(rank, {step.node.output[0]: out})


def _attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, step: FusedAttentionStep, offset: int
) -> np.ndarray:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"Q, K and V must be [batch, heads, seq, head_dim], got ranks {q.ndim}, "
            f"{k.ndim}, {v.ndim}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} K/V heads")
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
    scale = step.scale if step.scale is not None else 1.0 / np.sqrt(q.shape[-1])
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * np.asarray(scale, dtype=q.dtype)
    if step.is_causal:
        queries = offset + np.arange(q.shape[2])[:, None]
        keys = np.arange(k.shape[2])[None, :]
        scores = np.where(keys <= queries, scores, np.asarray(-np.inf, dtype=scores.dtype))
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.matmul(weights, v).astype(q.dtype)
