"""The public API: every name in ``__all__`` resolves, and importing the package is cheap."""

from __future__ import annotations

import subprocess
import sys

import shardcheck


def test_every_public_name_resolves() -> None:
    for name in shardcheck.__all__:
        assert getattr(shardcheck, name) is not None


def test_import_does_not_load_onnx_or_onnxruntime() -> None:
    code = "import sys, shardcheck; print('onnx' in sys.modules, 'onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"]
