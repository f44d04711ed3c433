"""--timeout holds for a single long kernel: onnxruntime checks ``terminate`` only between
nodes. The console command ends its process past the timeout; a caller whose process must go
on (the gate) makes the runs in a child process, killed past it (runtime/supervised.py).

The model is one MatMul of [S, 4096] by [4096, S]: at S = 16384 it is 2.2 TFLOP, many seconds
on any CPU with one thread, far past the timeout of 1 s and its grace of 2 s. No test measures
time: each returns, says that the process was stopped (onnxruntime's own stop between nodes says
otherwise), and is bounded only by a generous subprocess timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LONG_LENGTH, ROOT, long_matmul_model, run_cli

from shardcheck.errors import InputError
from shardcheck.runtime.supervised import run_supervised
from shardcheck.simulation.simulate import simulate
from shardcheck.verification.verify import verify_in_child

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
STOPPED = "its process was stopped"


def _one_long_matmul(directory: Path) -> tuple[Path, Path]:
    """The model and its hints (gen's: no layer, nothing scattered)."""
    model = long_matmul_model(directory / "long.onnx")
    hints = directory / "long.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    return model, hints


@pytest.mark.parametrize("ranks", [[], ["--ranks", "1"]], ids=["verify", "verify --ranks 1"])
def test_verify_timeout_stops_a_single_long_kernel(tmp_path: Path, ranks: list[str]) -> None:
    model, hints = _one_long_matmul(tmp_path)
    argv = ["verify", model, hints, "--seq-lens", f"8,{LONG_LENGTH}", "--timeout", "1", *ranks]
    process = subprocess.run(
        [sys.executable, "-m", "shardcheck", *map(str, argv)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
        check=False,
    )
    assert process.returncode == 2, process.stderr
    last = process.stderr.splitlines()[-1]
    assert last.startswith("shardcheck: error: ")
    assert f"did not finish within --timeout 1.0 s (sequence length {LONG_LENGTH})" in last
    assert STOPPED in last


def test_the_simulations_runs_are_bounded_too(tmp_path: Path) -> None:
    """The simulation's single-device run and its stages report their runs as verify's do;
    the timeout of the call that makes them covers them (``run_supervised``, what verify and
    the gate's verify items use)."""
    model, hints = _one_long_matmul(tmp_path)
    arguments = {"model_path": model, "hints": hints, "ranks": 1, "seq_len": LONG_LENGTH}
    with pytest.raises(InputError, match=STOPPED):
        run_supervised(simulate, arguments, timeout=1, source=str(model))


def test_verify_in_a_child_process_is_stopped_past_its_timeout(tmp_path: Path) -> None:
    """What the gate and the pytest plugin call: the caller's process goes on."""
    model, hints = _one_long_matmul(tmp_path)
    with pytest.raises(InputError, match=STOPPED):
        verify_in_child(model, hints, timeout=1, seq_lens=(8, LONG_LENGTH))
    report = verify_in_child(model, hints, timeout=60, seq_lens=(8, 16))
    assert report.ok, report.render_text()


def test_a_supervised_call_answers_as_the_call_would(tmp_path: Path) -> None:
    """What the child returns or raises comes back as it is."""
    model, hints = _one_long_matmul(tmp_path)
    arguments = {"model_path": model, "hints": hints, "ranks": 1, "seq_len": 8}
    result = run_supervised(simulate, arguments, timeout=60, source=str(model))
    assert result.ok and result.seq_len == 8
    arguments["seq_len"] = 0
    with pytest.raises(InputError, match="--seq-len 0"):
        run_supervised(simulate, arguments, timeout=60, source=str(model))


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_check_verify_stops_a_single_long_kernel_and_goes_on(tmp_path: Path, jobs: str) -> None:
    """check verifies each model in a child process (forked: the command makes no session
    itself), killed past the manifest's timeout; the next model is still checked."""
    model, _ = _one_long_matmul(tmp_path)
    (tmp_path / "short.onnx").write_bytes(model.read_bytes())
    manifest = tmp_path / "pyproject.toml"
    manifest.write_text(
        "[tool.shardcheck]\n"
        "timeout = 1\n"
        "[[tool.shardcheck.models]]\n"
        f'path = "{model.name}"\n'
        'golden = "long_golden.json"\n'
        "verify = true\n"
        f"seq-lens = [8, {LONG_LENGTH}]\n"
        "[[tool.shardcheck.models]]\n"
        'path = "short.onnx"\n'
        'golden = "short.json"\n'
        "verify = true\n"
        "seq-lens = [8, 16]\n"
    )
    argv = ["check", "--manifest", str(manifest), "--verify", "--update", "--jobs", jobs]
    process = subprocess.run(
        [sys.executable, "-m", "shardcheck", *argv],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
        check=False,
    )
    assert process.returncode == 1, process.stdout + process.stderr
    results = [line for line in process.stdout.splitlines() if not line.startswith(" ")]
    long_line, short_line = results[:2]  # in manifest order
    assert long_line.startswith("ERROR") and STOPPED in long_line, process.stdout
    assert f"(sequence length {LONG_LENGTH})" in long_line
    assert short_line.startswith("CREATED"), process.stdout
    assert not (tmp_path / "long_golden.json").exists()  # hints that fail verify are not the golden
