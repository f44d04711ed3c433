"""Writes that replace a file never leave it partial: gen -o, shard -o and fmt -o.

(``check --update``'s goldens are tested the same way in test_cli_check.py.)

Three ways a write can be cut, each in a real shardcheck process over an existing output:

- killed in the middle of the write, deterministically: the file-size limit (RLIMIT_FSIZE) is
  set below the new output's size and SIGXFSZ is left at its default action, so the kernel
  kills the process the moment its write crosses the limit. The partial temporary file that
  remains proves the write was cut; the output must still hold its old bytes;
- failing in the middle of the write: the same limit with SIGXFSZ ignored (as CPython does by
  default), so the write fails with EFBIG: exit 2, one line, the old bytes, and no temporary
  file left behind;
- SIGKILL at random moments (seeded) from the start or just after the write began: the output
  holds the old bytes or the new ones, nothing else.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, GOLDEN, ROOT, run_cli

from shardcheck import fsio
from shardcheck.hints.codec import dumps
from shardcheck.hints.files import read_hints

resource = pytest.importorskip("resource")
pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX limits")

MODEL = FIXTURES / "attention_head.onnx"
HINTS = GOLDEN / "attention_head.json"
# The child runs the real CLI, with SIGXFSZ at its default action (CPython ignores it).
KILLABLE_CLI = (
    "import signal; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); "
    "from shardcheck.cli import main; main()"
)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}


def _old_hints() -> bytes:
    """A valid hints file that differs from what gen writes (a drifted golden)."""
    hints = read_hints(HINTS)
    return dumps(hints.with_changes(k_seq_len_idx=hints.k_seq_len_idx + 1)).encode()


# command -> (argv for a project directory and its output, the output's old bytes)
COMMANDS: dict[str, tuple[Callable[[Path, Path], list[str]], Callable[[], bytes]]] = {
    "gen -o": (lambda d, out: ["gen", str(d / "model.onnx"), "-o", str(out)], _old_hints),
    "shard -o": (
        lambda d, out: ["shard", str(d / "model.onnx"), str(d / "hints.json"), "-o", str(out)],
        lambda: MODEL.read_bytes(),  # a model is there: the sharded one replaces it
    ),
    "fmt -o": (lambda d, out: ["fmt", str(d / "hints.json"), "-o", str(out)], _old_hints),
}


_WRITTEN: dict[str, bytes] = {}


def _project(directory: Path, command: str) -> tuple[list[str], Path, bytes, bytes]:
    """The argv, the output path, its old bytes and the bytes a full run writes."""
    shutil.copy(MODEL, directory / "model.onnx")
    shutil.copy(HINTS, directory / "hints.json")
    argv_for, old_bytes = COMMANDS[command]
    if command not in _WRITTEN:  # what a run that is not cut writes (once per command)
        reference = directory / "reference.out"
        finished = _run(argv_for(directory, reference))
        assert finished.returncode == 0, finished.stderr
        _WRITTEN[command] = reference.read_bytes()
        reference.unlink()
    new = _WRITTEN[command]
    output = directory / "out" / "output"
    output.parent.mkdir()
    old = old_bytes()
    output.write_bytes(old)
    assert old != new
    return argv_for(directory, output), output, old, new


def _run(
    argv: list[str], *, file_size_limit: int | None = None, killable: bool = False
) -> subprocess.CompletedProcess[str]:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    head = ["-c", KILLABLE_CLI] if killable else ["-m", "shardcheck"]
    return subprocess.run(
        [sys.executable, *head, *argv],
        env=ENV,
        preexec_fn=limits,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _temporaries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_killed_in_the_middle_of_the_write_leaves_the_old_file(
    tmp_path: Path, command: str
) -> None:
    argv, output, old, new = _project(tmp_path, command)
    cut = len(new) // 2

    process = _run(argv, file_size_limit=cut, killable=True)

    assert process.returncode == -signal.SIGXFSZ, process.stderr
    assert output.read_bytes() == old
    # The kill came inside the write: half of the new bytes are in the temporary file.
    (partial,) = _temporaries(output.parent)
    assert partial.read_bytes() == new[:cut]
    assert partial.name.startswith(f".{output.name}.")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, command: str
) -> None:
    argv, output, old, new = _project(tmp_path, command)

    process = _run(argv, file_size_limit=len(new) // 2)

    assert process.returncode == 2
    assert process.stderr.splitlines() == [
        f"shardcheck: error: {output}: cannot write: File too large"
    ]
    assert output.read_bytes() == old
    assert sorted(output.parent.iterdir()) == [output]


def _wait_for_first_write(directory: Path, process: subprocess.Popen[bytes]) -> None:
    """Until the temporary file appears (the directory changes) or the process ends."""
    start = directory.stat().st_mtime_ns
    deadline = time.monotonic() + 60
    while directory.stat().st_mtime_ns == start and process.poll() is None:
        assert time.monotonic() < deadline, "nothing was written in 60 s"
        time.sleep(0.0005)


@pytest.mark.parametrize("command", ["gen -o", "shard -o"])
def test_sigkill_at_any_moment_leaves_the_old_file_or_the_new_one(
    tmp_path: Path, command: str
) -> None:
    argv, output, old, new = _project(tmp_path, command)
    rng = random.Random(20240612)
    moments = [("start", rng.uniform(0.0, 0.6)) for _ in range(2)]
    moments += [("first write", rng.uniform(0.0, 0.004)) for _ in range(4)]
    for anchor, delay in moments:
        output.write_bytes(old)
        for leftover in _temporaries(output.parent):
            leftover.unlink()
        process = subprocess.Popen(
            [sys.executable, "-m", "shardcheck", *argv],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if anchor == "first write":
            _wait_for_first_write(output.parent, process)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        data = output.read_bytes()
        assert data in (old, new), f"{output.name} partial after a kill at {anchor} + {delay:.4f}s"
    # Finishing afterwards writes the new bytes, whatever the kills left behind.
    assert _run(argv).returncode == 0
    assert output.read_bytes() == new


# ------------------------------------------------------------------ outputs that are not files


def _char_device(path: Path) -> Path:
    """A node like /dev/null (1, 3) in the test's directory, never the real one: a regression
    would replace it."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


def test_an_output_that_is_a_device_is_written_into_not_replaced(tmp_path: Path) -> None:
    """'-o /dev/null' once replaced /dev/null by a regular file (a rename over the node)."""
    shutil.copy(HINTS, tmp_path / "hints.json")
    weights = tmp_path / "weights"
    weights.mkdir()
    model = weights / "model.onnx"
    onnx.save_model(
        onnx.load(MODEL), model, save_as_external_data=True, location="w.bin", size_threshold=0
    )
    (tmp_path / "m.toml").write_text(
        f'[[tool.shardcheck.models]]\npath = "{model}"\ngolden = "hints.json"\n'
    )
    null = _char_device(tmp_path / "null")
    before = sorted(tmp_path.iterdir())
    for argv in (
        ["gen", model, "-o", null],
        ["shard", model, tmp_path / "hints.json", "-o", null],
        ["fmt", tmp_path / "hints.json", "-o", null],
        ["check", "--manifest", tmp_path / "m.toml", "--report", null],
    ):
        result = run_cli(*argv)
        assert result.exit_code in (0, 1), result.stderr  # check: the golden may differ
        assert stat.S_ISCHR(null.stat().st_mode), f"{argv[0]} replaced the device"
        # no temporary file, and no weight file copied next to the device (shard)
        assert sorted(tmp_path.iterdir()) == before, argv[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("command", ["gen -o", "shard -o"])
def test_an_output_that_is_a_pipe_receives_the_bytes(tmp_path: Path, command: str) -> None:
    argv, output, _, new = _project(tmp_path, command)
    output.unlink()
    os.mkfifo(output)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(output.read_bytes()), daemon=True)
    reader.start()

    result = run_cli(*argv)

    reader.join(timeout=60)
    assert result.exit_code == 0, result.stderr
    assert received == [new]
    assert stat.S_ISFIFO(output.stat().st_mode)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
@pytest.mark.parametrize("command", ["gen", "fmt"])
def test_an_output_that_is_a_link_replaces_the_file_it_points_to(
    tmp_path: Path, command: str
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "hints.json"
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(os.path.relpath(target, tmp_path))
    flat = tmp_path / "flat.json"  # fmt's input: the golden, already in the 0.53.6 format
    shutil.copy(HINTS, flat)

    argv = ["gen", MODEL, "-o", link] if command == "gen" else ["fmt", flat, "-o", link]
    result = run_cli(*argv)

    assert result.exit_code == 0, result.stderr
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert read_hints(target) == read_hints(HINTS)
    assert sorted(p.name for p in shared.iterdir()) == ["hints.json"]  # no temporary left


def test_a_stop_the_moment_the_temporary_file_exists_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGINT to the main thread the moment the temporary file is made (as a signal that comes
    # while the process returns from the open): its KeyboardInterrupt is raised there, with
    # Python's own handler, and the file is removed.
    opened = os.open
    main = threading.main_thread().ident
    assert main is not None

    def open_then_interrupted(path: str, flags: int, mode: int = 0o777) -> int:
        handle = opened(path, flags, mode)
        if str(path).endswith(".tmp"):
            signal.pthread_kill(main, signal.SIGINT)
        return handle

    monkeypatch.setattr(fsio.os, "open", open_then_interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    target = tmp_path / "out.json"
    try:
        with pytest.raises(KeyboardInterrupt):
            fsio.atomic_write_text(target, "{}\n")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.iterdir()) == []
