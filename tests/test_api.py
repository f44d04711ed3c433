"""The public API: every name in ``__all__`` resolves to what it names."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

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


def _analyses(name: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """The analysis ``name`` runs, with the collector left as it is, and the call itself."""
    from shardcheck import GenOptions, generate, load_index, simulate, verify
    from shardcheck.generation.generate import generate_detected

    model = FIXTURE.parent / "real" / "dynamo_llama_tiny_gqa.onnx"
    hints = FIXTURE.parents[1] / "golden" / "real" / "dynamo_llama_tiny_gqa.json"
    if name == "generate":
        index, options = load_index(model), GenOptions()
        return lambda: generate_detected(index, options), lambda: generate(index, options)
    if name == "verify":
        return lambda: verify.__wrapped__(model, hints), lambda: verify(model, hints)
    return (
        lambda: simulate.__wrapped__(model, hints, ranks=2, seq_len=8),
        lambda: simulate(model, hints, ranks=2, seq_len=8),
    )


@pytest.mark.parametrize("name", ["generate", "verify", "simulate"])
def test_the_analyses_pause_the_cyclic_collector_and_restore_its_state(name: str) -> None:
    import gc

    unpaused, call = _analyses(name)
    collections: list[str] = []

    def count(phase: str, info: object) -> None:
        if phase == "start":
            collections.append(phase)

    def collections_during(analysis: Callable[[], object]) -> int:
        gc.collect()  # the young generation starts empty: a few allocations cannot fill it
        collections.clear()
        analysis()
        return len(collections)

    thresholds = gc.get_threshold()
    gc.set_threshold(50, 10, 10)  # collections far more often than by default
    gc.callbacks.append(count)
    try:
        # The same analysis with the collector running collects many times.
        assert collections_during(unpaused) > 10
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            # At most one: the one the first allocation after the pause sets off.
            assert collections_during(call) <= 1
            assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
        gc.enable()


def test_a_function_named_like_its_module_stays_the_function_after_the_module_is_imported() -> None:
    code = (
        "import types, shardcheck.simulation.simulate, shardcheck.verification.verify\n"
        "import shardcheck.generation.generate\n"
        "import shardcheck\n"
        "names = ('generate', 'simulate', 'verify')\n"
        "print(all(callable(getattr(shardcheck, n)) and not isinstance(getattr(shardcheck, n), "
        "types.ModuleType) for n in names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["True"]


def test_every_runtime_dependency_is_one_the_package_imports() -> None:
    # onnx-graphsurgeon was a runtime dependency the package never imported; it is the test
    # oracle's (Polygraphy's) now. A runtime dependency must be one the package uses.
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    imported_as = {
        "onnxruntime": "onnxruntime",
        "onnx": "onnx",
        "deepdiff": "deepdiff",
        "numpy": "numpy",
        "click": "click",
        "tomli": "tomli",
    }
    source = "\n".join(p.read_text() for p in (root / "shardcheck").rglob("*.py"))
    for requirement in project["dependencies"]:
        name = requirement.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        assert name in imported_as, f"{name}: a runtime dependency the test does not know"
        module = imported_as[name]
        assert f"import {module}" in source or f"from {module}" in source, name
