"""shardcheck: context-parallel shard hints for ONNX models, generated, verified and gated."""

from __future__ import annotations

from shardcheck.detect import AttentionLayer, detect_attention
from shardcheck.diff import diff_hints
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
from shardcheck.report import Report
from shardcheck.simulate import simulate
from shardcheck.verify import verify

__all__ = [
    "AttentionLayer",
    "AttentionLayerHint",
    "DistCollective",
    "FusedAttention",
    "GenOptions",
    "GenResult",
    "GraphIndex",
    "HintsFormatError",
    "InputError",
    "ModelError",
    "Report",
    "ShardHints",
    "ShardTensor",
    "ShardcheckError",
    "detect_attention",
    "diff_hints",
    "dumps",
    "generate",
    "load_index",
    "loads",
    "read_hints",
    "read_model",
    "simulate",
    "verify",
    "write_hints",
]
