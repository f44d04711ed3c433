"""What a real process meets and CliRunner cannot show: its own stdout and stderr as output
paths, a full disk or a closed pipe on stdout, signals, a model file cut while it is read,
two processes writing into one directory.

Each table is data: an output stream is tried with every command that writes a file, a stdout
failure with every command that writes to stdout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, GOLDEN, ROOT, attention_model, run_cli

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs /proc and /dev/fd")

MODEL = FIXTURES / "attention_head.onnx"
HINTS = GOLDEN / "attention_head.json"
OTHER_HINTS = GOLDEN / "multi_attention.json"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
SHARDCHECK = [sys.executable, "-m", "shardcheck"]


def _run(argv: list[str], **streams: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*SHARDCHECK, *map(str, argv)], env=ENV, timeout=120, check=False, **streams
    )


def _one_error_line(stderr: bytes) -> str:
    lines = stderr.decode().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("shardcheck: error: "), lines[0]
    assert "internal error" not in lines[0] and "Traceback" not in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ output paths that are streams

# command -> argv writing to OUT, and what it writes is (hints JSON, or an ONNX model).
WRITERS: dict[str, Callable[[Path], list[object]]] = {
    "gen": lambda out: ["gen", MODEL, "-o", out],
    "fmt": lambda out: ["fmt", HINTS, "-o", out],
    "shard": lambda out: ["shard", MODEL, HINTS, "-o", out],
}


def _stream_paths(tmp_path: Path) -> dict[str, tuple[str, int]]:
    """A name of stdout or stderr -> (the path, the descriptor it leads to)."""
    link = tmp_path / "link_to_stdout"
    link.symlink_to("/dev/stdout")
    return {
        "/dev/stdout": ("/dev/stdout", 1),
        "/dev/fd/1": ("/dev/fd/1", 1),
        "/proc/self/fd/1": ("/proc/self/fd/1", 1),
        "/dev/stderr": ("/dev/stderr", 2),
        "link-to-/dev/stdout": (str(link), 1),
    }


def _expected(command: str, tmp_path: Path) -> bytes:
    """What the command writes to a plain file (run in this process: it is the same code)."""
    plain = tmp_path / f"plain_{command}"
    assert run_cli(*WRITERS[command](plain)).exit_code == 0
    return plain.read_bytes()


STREAM_CASES = [
    *(("gen", stream) for stream in ("/dev/fd/1", "/proc/self/fd/1", "link-to-/dev/stdout")),
    *((command, stream) for command in WRITERS for stream in ("/dev/stdout", "/dev/stderr")),
]


@pytest.mark.parametrize(("command", "stream"), STREAM_CASES)
def test_an_output_that_is_a_stream_is_appended_to_never_replaced(
    tmp_path: Path, command: str, stream: str
) -> None:
    """``gen M -o /dev/stdout >> log.txt`` keeps what log.txt held: the stream is written in
    place, as ``-o -`` is, not replaced by a renamed temporary file."""
    path, fd = _stream_paths(tmp_path)[stream]
    log = tmp_path / "log.txt"
    log.write_bytes(b"earlier line\n")
    with open(log, "ab") as appended:
        redirected = {"stdout" if fd == 1 else "stderr": appended}
        other = {"stderr" if fd == 1 else "stdout": subprocess.PIPE}
        result = _run(WRITERS[command](Path(path)), **redirected, **other)
    assert result.returncode == 0, result
    written = log.read_bytes()
    assert written.startswith(b"earlier line\n")
    if fd == 1:
        assert written == b"earlier line\n" + _expected(command, tmp_path)
    else:  # stderr has the command's own lines too (a warning, say)
        assert _expected(command, tmp_path) in written
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["log.txt", "link_to_stdout", f"plain_{command}"]
    ), "a temporary file or a weight copy was left"


@pytest.mark.parametrize("command", list(WRITERS))
def test_an_output_that_is_stdout_works_into_a_pipe(tmp_path: Path, command: str) -> None:
    result = _run(WRITERS[command](Path("/dev/stdout")), capture_output=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == _expected(command, tmp_path)


# ------------------------------------------------------------------ stdout that fails

# command -> argv that writes to stdout (diff: two files that differ, so it has lines to say).
STDOUT_WRITERS: dict[str, list[object]] = {
    "gen -o -": ["gen", MODEL, "-o", "-"],
    "gen -o /dev/stdout": ["gen", MODEL, "-o", "/dev/stdout"],
    "fmt -o -": ["fmt", HINTS, "-o", "-"],
    "verify": ["verify", MODEL, HINTS],
    "diff": ["diff", HINTS, OTHER_HINTS],
    "simulate": ["simulate", MODEL, HINTS, "--ranks", "2", "--seq-len", "8"],
}


@pytest.mark.parametrize("command", list(STDOUT_WRITERS))
def test_stdout_on_a_full_disk_is_one_error_line(command: str) -> None:
    with open("/dev/full", "wb") as full:
        result = _run(STDOUT_WRITERS[command], stdout=full, stderr=subprocess.PIPE)
    assert result.returncode == 2
    assert "No space left on device" in _one_error_line(result.stderr)


@pytest.mark.parametrize("command", list(STDOUT_WRITERS))
def test_a_closed_stdout_pipe_is_its_own_quiet_exit(command: str) -> None:
    """``diff A B | head -0``: the reader is gone before anything is written. That is exit
    141 (128 + SIGPIPE, as a shell reports a program SIGPIPE ended), never 1 ("different")
    nor 0, and no line on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = _run(STDOUT_WRITERS[command], stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr
    assert result.stderr == b""


# ------------------------------------------------------------------ pipes as inputs


def test_a_model_from_a_pipe_is_read_and_an_empty_pipe_is_not_an_empty_file() -> None:
    """``gen <(cat m.onnx)``: a pipe is read to its end; one that gives nothing says so."""

    def gen_from(command: str) -> subprocess.CompletedProcess[bytes]:
        script = f'"$@" gen <({command}) -o -'
        return subprocess.run(
            ["bash", "-c", script, "_", *SHARDCHECK],
            env=ENV,
            capture_output=True,
            timeout=120,
            check=False,
        )

    fed = gen_from(f"cat {MODEL}")
    assert fed.returncode == 0, fed.stderr
    assert json.loads(fed.stdout) == json.loads(HINTS.read_text())
    empty = gen_from("true")
    assert empty.returncode == 2
    line = _one_error_line(empty.stderr)
    assert "is a pipe that gave nothing to read, expected an ONNX model" in line
    assert "empty file" not in line


# ------------------------------------------------------------------ a model file cut while read


def test_a_model_file_truncated_while_gen_reads_it_never_kills_gen(tmp_path: Path) -> None:
    """The file is read, not mapped: cut at any moment, gen answers (exit 0 with the hints,
    or exit 2 with one line), never dies of SIGBUS (exit 135 with no message). The cut comes
    at a few seeded moments while a 32 MiB model is read."""
    model = onnx.load(MODEL)
    rng = np.random.default_rng(30)
    padding = rng.standard_normal(8 * 1024 * 1024).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(padding, "padding"))
    source = tmp_path / "source.onnx"
    onnx.save(model, source)
    delays = np.random.default_rng(135).uniform(0.05, 1.0, size=2)
    for delay in delays:
        target = tmp_path / "model.onnx"
        shutil.copy(source, target)
        process = subprocess.Popen(
            [*SHARDCHECK, "gen", str(target), "-o", str(tmp_path / "h.json")],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        time.sleep(delay)
        with open(target, "r+b") as cut:
            cut.truncate(1000)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode in (0, 2), (process.returncode, stderr)
        if process.returncode == 2:
            _one_error_line(stderr)


# ------------------------------------------------------------------ signals


def _big_external_model(directory: Path, megabytes: int = 100) -> Path:
    """attention_model's weights in weights.bin, padded to ``megabytes`` with one more."""
    path = attention_model(directory, external=True)
    model = onnx.load(path)
    padding = np.zeros(megabytes * 256 * 1024, np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(padding, "padding"))
    onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    return path


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_shard_leaves_no_temporary_file_nor_weight_copy(
    tmp_path: Path, signum: int
) -> None:
    """shard copies 100 MB of weights next to its output; the signal comes while the copy is
    under way (its temporary file exists). Nothing is left in the output directory, and the
    answer is one line with exit 128 + the signal."""
    source = tmp_path / "source"
    source.mkdir()
    model = _big_external_model(source)
    hints = tmp_path / "hints.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    process = subprocess.Popen(
        [*SHARDCHECK, "shard", str(model), str(hints), "-o", str(out / "md.onnx")],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not any(out.iterdir()) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    if process.returncode == 0:
        pytest.skip("shard was done before the signal came")
    assert process.returncode == 128 + signum, stderr
    assert list(out.iterdir()) == []
    line = _one_error_line(stderr)
    assert line in (
        "shardcheck: error: interrupted",
        f"shardcheck: error: terminated by {signal.Signals(signum).name}",
    )
    assert not stderr.startswith(b"\n"), "a blank line before the error"


# ------------------------------------------------------------------ two processes, one directory


def test_two_concurrent_shards_into_one_directory_both_succeed(tmp_path: Path) -> None:
    """Both copy the same weight file next to their outputs: each through a temporary file
    of its own (fsio's atomic writer), so neither fails nor sees a part of the other's."""
    source = tmp_path / "source"
    source.mkdir()
    model = _big_external_model(source, megabytes=20)
    hints = tmp_path / "hints.json"
    assert run_cli("gen", model, "-o", hints).exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    for attempt in range(2):
        processes = [
            subprocess.Popen(
                [*SHARDCHECK, "shard", str(model), str(hints), "-o", str(out / f"md{i}.onnx")],
                env=ENV,
                stderr=subprocess.PIPE,
            )
            for i in range(2)
        ]
        for process in processes:
            _, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, (attempt, stderr)
        assert sorted(p.name for p in out.iterdir()) == ["md0.onnx", "md1.onnx", "weights.bin"]
        assert (out / "weights.bin").read_bytes() == (source / "weights.bin").read_bytes()
        for written in out.iterdir():
            written.unlink()
