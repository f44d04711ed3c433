"""shardcheck: context-parallel shard hints for ONNX models, generated, verified and gated."""

from __future__ import annotations

from shardcheck.errors import HintsFormatError, InputError, ModelError, ShardcheckError
from shardcheck.generate import GenResult, generate
from shardcheck.graph import GraphIndex
from shardcheck.hints import (
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
    ShardTensor,
    dumps,
    loads,
)
from shardcheck.hints_file import read_hints, write_hints
from shardcheck.loader import load_index, read_model
from shardcheck.options import GenOptions

__all__ = [
    "AttentionLayerHint",
    "DistCollective",
    "FusedAttention",
    "GenOptions",
    "GenResult",
    "GraphIndex",
    "HintsFormatError",
    "InputError",
    "ModelError",
    "ShardHints",
    "ShardTensor",
    "ShardcheckError",
    "dumps",
    "generate",
    "load_index",
    "loads",
    "read_hints",
    "read_model",
    "write_hints",
]
