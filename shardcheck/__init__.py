"""shardcheck: context-parallel shard hints for ONNX models, generated, verified and gated.

Every name below is imported on first use, so that ``shardcheck gen`` imports neither deepdiff
nor onnxruntime (which only the modules that run models import, when they run one), nor the
modules of the other commands.

The subpackages read bottom-up as the pipeline: ``graph`` (reading ONNX) -> ``analysis`` (shapes,
attention, axes) -> ``frontier`` (where to cut) -> ``hints`` (the file) -> ``generation`` (gen) ->
``runtime`` (onnxruntime) -> ``sharding`` and ``simulation`` -> ``verification`` -> ``gating``,
with ``cli`` and ``pytest_plugin`` on top.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardcheck.analysis.detect import AttentionLayer, detect_attention
    from shardcheck.errors import HintsFormatError, InputError, ModelError, ShardcheckError
    from shardcheck.generation.generate import generate
    from shardcheck.generation.options import GenOptions
    from shardcheck.generation.parts import GenResult
    from shardcheck.graph.index import GraphIndex
    from shardcheck.graph.loader import load_index, read_model
    from shardcheck.hints.codec import dumps, loads
    from shardcheck.hints.diff import diff_hints
    from shardcheck.hints.files import read_hints, write_hints
    from shardcheck.hints.model import (
        AttentionLayerHint,
        DistCollective,
        FusedAttention,
        ShardHints,
        ShardTensor,
    )
    from shardcheck.simulation.simulate import simulate
    from shardcheck.verification.findings import Report
    from shardcheck.verification.verify import verify

_MODULES = {
    "shardcheck.analysis.detect": ("AttentionLayer", "detect_attention"),
    "shardcheck.hints.diff": ("diff_hints",),
    "shardcheck.errors": ("HintsFormatError", "InputError", "ModelError", "ShardcheckError"),
    "shardcheck.generation.generate": ("generate",),
    "shardcheck.generation.parts": ("GenResult",),
    "shardcheck.graph.index": ("GraphIndex",),
    "shardcheck.hints.model": (
        "AttentionLayerHint",
        "DistCollective",
        "FusedAttention",
        "ShardHints",
        "ShardTensor",
    ),
    "shardcheck.hints.codec": ("dumps", "loads"),
    "shardcheck.hints.files": ("read_hints", "write_hints"),
    "shardcheck.graph.loader": ("load_index", "read_model"),
    "shardcheck.generation.options": ("GenOptions",),
    "shardcheck.verification.findings": ("Report",),
    "shardcheck.simulation.simulate": ("simulate",),
    "shardcheck.verification.verify": ("verify",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

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


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'shardcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
