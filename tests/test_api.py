"""The public API: every name in ``__all__`` resolves to what it names."""

from __future__ import annotations

import subprocess
import sys
import types

import shardcheck


def test_every_public_name_resolves_to_a_function_or_class_not_a_module() -> None:
    for name in shardcheck.__all__:
        assert not isinstance(getattr(shardcheck, name), types.ModuleType), name


def test_import_does_not_load_onnxruntime() -> None:
    code = "import sys, shardcheck; print('onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False"]
