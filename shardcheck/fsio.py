"""Files: the one test that an input path names something to read, and output that never
leaves a user's file half-written."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from shardcheck.errors import OutputError

# A name of an open file descriptor: /dev/stdout, /dev/fd/1 and /proc/self/fd/1 lead here.
_FD_NAME = re.compile(r"/proc/(\d+)(?:/task/\d+)?/fd/(\d+)")
# What a temporary file's name keeps of the target's: "." + it + ".XXXXXXXX.tmp" fits in 255.
_MAX_TEMP_STEM_BYTES = 200
_MAX_LINKS = 40  # as the kernel's limit on links followed in one path


def nul_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with a path holding a NUL byte, or None: no system call takes one, so
    it is refused before any (the caller raises its own error with it, after the path)."""
    return "a path cannot hold a NUL byte" if "\0" in os.fspath(path) else None


def why_unreadable(path: str | os.PathLike[str], what: str) -> str | None:
    """Why ``path`` names nothing to read as ``what`` ("no such file", "is a directory, ..."),
    or None. The caller raises its own error with it, after the path."""
    file = Path(path)
    try:
        if not file.exists():
            return "no such file"
        if file.is_dir():
            return f"is a directory, expected {what}"
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte
        return f"cannot be read: {getattr(exc, 'strerror', None) or exc}"
    return None


def nothing_read(path: str | os.PathLike[str], what: str) -> str:
    """What to say of an input that gave no bytes: an empty file, or a pipe or a device that
    gave nothing (``<(...)`` whose command wrote nothing, /dev/null)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        mode = stat.S_IFREG
    if stat.S_ISREG(mode):
        return f"empty file, expected {what}"
    kind = "pipe" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device"
    return f"is a {kind} that gave nothing to read, expected {what}"


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


def open_stream(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(pid, fd)`` when ``path`` leads, through links, to an open file descriptor
    (``/dev/stdout``, ``/dev/fd/1``, ``/proc/<pid>/fd/N``, a link to one of them); else None.

    Such a name is a stream, not a file to replace: the file behind it (``>> log.txt``)
    belongs to whoever opened it, and renaming a temporary file over it would destroy it."""
    current = os.path.abspath(os.fspath(path))
    for _ in range(_MAX_LINKS):
        parent, name = os.path.split(current)
        try:
            candidate = os.path.join(os.path.realpath(parent), name)
        except (OSError, ValueError):
            return None
        match = _FD_NAME.fullmatch(candidate)
        if match:
            return int(match.group(1)), int(match.group(2))
        if name in ("", ".", "..") or not os.path.islink(candidate):
            return None
        try:
            current = os.path.join(os.path.dirname(candidate), os.readlink(candidate))
        except (OSError, ValueError):
            return None
    return None


def write_to_stream(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> bool:
    """Write in place into the open stream ``path`` names (``open_stream``), as ``-`` is
    written to standard output: never truncated, never replaced. False when ``path`` names no
    stream."""
    stream = open_stream(path)
    if stream is None:
        return False
    pid, fd = stream
    try:
        if pid == os.getpid() and fd in (1, 2):
            standard = sys.stdout if fd == 1 else sys.stderr
            standard.flush()
            write(standard.buffer)
            standard.buffer.flush()
        elif pid == os.getpid():
            with os.fdopen(os.dup(fd), "wb") as duplicate:
                write(duplicate)
        else:  # another process's descriptor: opened anew, appended to, never truncated
            with open(os.open(path, os.O_WRONLY | os.O_APPEND), "wb") as opened:
                write(opened)
    except BrokenPipeError:
        raise  # the reader is gone: the CLI's own clean exit
    except OSError as exc:
        raise OutputError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return True


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data``: a temporary file in the same directory, then a rename.

    A reader (or a crash at any moment) sees the old file or the new one, never a part. On
    failure the temporary file is removed and the old file is untouched. Through a symbolic
    link, the file it points to is replaced, and the link kept. A stream (``/dev/stdout``)
    is written in place (``write_to_stream``).
    """
    atomic_write_written(path, lambda stream: stream.write(data))


def atomic_write_written(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` with what ``write`` writes to the stream it is given (more than
    memory holds at once), as ``atomic_write_bytes`` replaces it."""
    if write_to_stream(path, write):
        return
    if os.path.islink(path):
        path = os.path.realpath(path)
    atomic_write_with(path, write)


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` with what ``write`` writes to the stream it is given, as
    ``atomic_write_bytes`` does, but without following a link at ``path``: the link itself is
    replaced. The temporary file has a name of its own, created exclusively, so that nothing
    already in the directory is written through or removed."""
    if write_to_stream(path, write):
        return
    target, directory = output_target(path)
    if target.exists() and not target.is_file() and not target.is_symlink():
        _write_in_place(target, write)  # a device or a pipe (-o /dev/null): never replaced
        return
    temp_name: str | None = None
    try:
        handle = -1
        for _ in range(_TEMP_NAMES_TRIED):
            # The name is known before the file exists: a stop (a signal's KeyboardInterrupt)
            # raised the moment after its creation still finds it to remove. mkstemp's name is
            # only known once it returns.
            temp_name = os.path.join(directory, f".{_temp_stem(target.name)}.{_token()}.tmp")
            with contextlib.suppress(FileExistsError):
                handle = os.open(temp_name, _TEMP_FLAGS, 0o600)
                break
        if handle < 0:
            raise FileExistsError(f"no free temporary name in {directory}")
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        _copy_mode(target, temp_name)
        os.replace(temp_name, target)
    except BaseException as exc:
        if temp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp_name)
        if isinstance(exc, OSError):
            raise OutputError(f"{target}: cannot write: {exc.strerror or exc}") from None
        raise
    _fsync_directory(directory)


# A temporary file is made as mkstemp makes one: exclusively, readable by its owner only, never
# through a link, and not inherited by a child process.
_TEMP_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


_TEMP_NAMES_TRIED = 100  # as mkstemp tries


def _token() -> str:
    return secrets.token_hex(4)


def _temp_stem(name: str) -> str:
    """The start of a temporary file's name for ``name``: all of it, unless the temporary
    name would pass the 255 bytes a file name may have (a legal 250-byte output name)."""
    if len(os.fsencode(name)) <= _MAX_TEMP_STEM_BYTES:
        return name
    return name[: _MAX_TEMP_STEM_BYTES // 4]  # at most 4 bytes a character in UTF-8


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
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            raise  # the reader is gone: the CLI's own clean exit
        except OSError as exc:
            why = exc.strerror or exc
            raise OutputError(f"-: cannot write to standard output: {why}") from None
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
