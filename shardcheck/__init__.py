"""shardcheck: context-parallel shard hints for ONNX models, generated, verified and gated.

Most names below are imported on first use, so that ``shardcheck gen`` never imports deepdiff
(nor onnxruntime, which only the modules that run models import, when they run one).
``generate``, ``verify`` and ``simulate`` are imported now: each shares its name with its
module, and importing the module later would rebind the package attribute to the module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardcheck.generate import generate
from shardcheck.simulate import simulate
from shardcheck.verify import verify

if TYPE_CHECKING:
    from shardcheck.detect import AttentionLayer, detect_attention
    from shardcheck.diff import diff_hints
    from shardcheck.errors import HintsFormatError, InputError, ModelError, ShardcheckError
    from shardcheck.generate import GenResult
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

_MODULES = {
    "shardcheck.detect": ("AttentionLayer", "detect_attention"),
    "shardcheck.diff": ("diff_hints",),
    "shardcheck.errors": ("HintsFormatError", "InputError", "ModelError", "ShardcheckError"),
    "shardcheck.generate": ("GenResult",),
    "shardcheck.graph": ("GraphIndex",),
    "shardcheck.hints": (
        "AttentionLayerHint",
        "DistCollective",
        "FusedAttention",
        "ShardHints",
        "ShardTensor",
        "dumps",
        "loads",
    ),
    "shardcheck.hints_file": ("read_hints", "write_hints"),
    "shardcheck.loader": ("load_index", "read_model"),
    "shardcheck.options": ("GenOptions",),
    "shardcheck.report": ("Report",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
_EAGER = ("generate", "simulate", "verify")

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
