"""The public API: every name in ``__all__`` resolves to what it names."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import shardcheck

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "attention.onnx"


def test_every_public_name_resolves_to_a_function_or_class_not_a_module() -> None:
    for name in shardcheck.__all__:
        assert not isinstance(getattr(shardcheck, name), types.ModuleType), name


def test_import_does_not_load_onnxruntime() -> None:
    code = "import sys, shardcheck; print('onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False"]


def test_every_public_name_has_a_home_module() -> None:
    assert sorted(shardcheck.__all__) == sorted(shardcheck._HOME)


def test_gen_does_not_import_onnxruntime_or_deepdiff(tmp_path: Path) -> None:
    code = (
        "import sys; from shardcheck.cli import cli; "
        f"cli.main(['gen', {str(FIXTURE)!r}, '-o', {str(tmp_path / 'h.json')!r}], "
        "standalone_mode=False); "
        "print(sorted(m for m in ('onnxruntime', 'deepdiff') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["[]"]
