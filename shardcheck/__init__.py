"""shardcheck: context-parallel shard hints for ONNX models, generated, verified and gated.

The public API is re-exported here lazily: ``import shardcheck`` stays cheap (the pytest plugin
is loaded by every pytest run in an environment where shardcheck is installed), and onnx,
numpy or onnxruntime are imported only when a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionLayer": "shardcheck.detect",
    "AttentionLayerHint": "shardcheck.hints",
    "DistCollective": "shardcheck.hints",
    "FusedAttention": "shardcheck.hints",
    "GenOptions": "shardcheck.options",
    "GenResult": "shardcheck.generate",
    "GraphIndex": "shardcheck.graph",
    "HintsFormatError": "shardcheck.errors",
    "InputError": "shardcheck.errors",
    "ModelError": "shardcheck.errors",
    "Report": "shardcheck.report",
    "ShardHints": "shardcheck.hints",
    "ShardTensor": "shardcheck.hints",
    "ShardcheckError": "shardcheck.errors",
    "detect_attention": "shardcheck.detect",
    "diff_hints": "shardcheck.diff",
    "dumps": "shardcheck.hints",
    "generate": "shardcheck.generate",
    "load_index": "shardcheck.loader",
    "loads": "shardcheck.hints",
    "read_hints": "shardcheck.hints_file",
    "read_model": "shardcheck.loader",
    "simulate": "shardcheck.simulate",
    "verify": "shardcheck.verify",
    "write_hints": "shardcheck.hints_file",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
