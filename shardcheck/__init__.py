"""shardcheck: context-parallel shard hints for ONNX models, generated, verified and gated.

Every name below is imported on first use, so that ``shardcheck gen`` imports neither deepdiff
nor onnxruntime (which only the modules that run models import, when they run one), nor the
modules of the other commands. ``generate``, ``verify`` and ``simulate`` share their names with
their modules: importing such a module binds it as an attribute of the package, which the
package class below declines, so that the name keeps meaning the function.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_MODULES = {
    "shardcheck.detect": ("AttentionLayer", "detect_attention"),
    "shardcheck.diff": ("diff_hints",),
    "shardcheck.errors": ("HintsFormatError", "InputError", "ModelError", "ShardcheckError"),
    "shardcheck.generate": ("GenResult", "generate"),
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
    "shardcheck.simulate": ("simulate",),
    "shardcheck.verify": ("verify",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
# The functions named like their modules.
_SHADOWING = frozenset(name for name in _HOME if _HOME[name] == f"shardcheck.{name}")

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


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # The import system binds a submodule to its package; for the modules named like a
        # public function, the name stays the function's.
        if name in _SHADOWING and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
