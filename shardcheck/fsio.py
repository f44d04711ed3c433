"""Files: the one test that an input path names something to read, and output that never
leaves a user's file half-written."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from shardcheck.errors import OutputError


def why_unreadable(path: str | os.PathLike[str], what: str) -> str | None:
    """Why ``path`` names nothing to read as ``what`` ("no such file", "is a directory, ..."),
    or None. The caller raises its own error with it, after the path."""
    file = Path(path)
    if not file.exists():
        return "no such file"
    if file.is_dir():
        return f"is a directory, expected {what}"
    return None


def output_target(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The file ``path`` names and its directory; OutputError if it cannot be a new file."""
    spelled = os.fspath(path)
    if not spelled:
        raise OutputError("'': cannot write: the output path is empty")
    if spelled.endswith(os.sep) or (os.altsep and spelled.endswith(os.altsep)):
        # Path() drops the slash: "out/" would become a file named "out".
        raise OutputError(
            f"{spelled}: cannot write: the path names a directory (it ends with "
            f"{spelled[-1]!r}); give a file name"
        )
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        shown = repr(str(directory))
        why = (
            f"{shown} is not a directory"
            if directory.exists()
            else f"directory {shown} does not exist"
        )
        raise OutputError(f"{target}: cannot write: {why}")
    if target.is_dir():
        raise OutputError(f"{target}: cannot write: is a directory")
    return target, directory


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data``: a temporary file in the same directory, then a rename.

    A reader (or a crash at any moment) sees the old file or the new one, never a part. On
    failure the temporary file is removed and the old file is untouched. Through a symbolic
    link, the file it points to is replaced, and the link kept.
    """
    if os.path.islink(path):
        path = os.path.realpath(path)
    atomic_write_with(path, lambda stream: stream.write(data))


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` with what ``write`` writes to the stream it is given, as
    ``atomic_write_bytes`` does, but without following a link at ``path``: the link itself is
    replaced. The temporary file has a name of its own, created exclusively, so that nothing
    already in the directory is written through or removed."""
    target, directory = output_target(path)
    if target.exists() and not target.is_file() and not target.is_symlink():
        _write_in_place(target, write)  # a device or a pipe (-o /dev/null): never replaced
        return
    try:
        handle, temp_name = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=".tmp", dir=directory
        )
    except OSError as exc:
        raise OutputError(f"{target}: cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        _copy_mode(target, temp_name)
        os.replace(temp_name, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        if isinstance(exc, OSError):
            raise OutputError(f"{target}: cannot write: {exc.strerror or exc}") from None
        raise
    _fsync_directory(directory)


def same_file(first: str | os.PathLike[str], second: str | os.PathLike[str]) -> bool:
    """True when both paths name one existing file (through links too)."""
    try:
        return os.path.samefile(first, second)
    except (OSError, ValueError):
        return False


def _write_in_place(target: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write into a file that is not a regular one. Renaming a temporary file over it would
    replace the device or pipe itself (as root, /dev/null became a regular file)."""
    try:
        with open(target, "wb") as stream:
            write(stream)
    except OSError as exc:
        raise OutputError(f"{target}: cannot write: {exc.strerror or exc}") from None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_text_or_stdout(path: str, text: str) -> None:
    """Write to ``path`` atomically; ``-`` means standard output."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        atomic_write_text(path, text)


def _copy_mode(target: Path, temp_name: str) -> None:
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(temp_name, mode)


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
