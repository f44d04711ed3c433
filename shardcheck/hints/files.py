"""Reading and writing hints files."""

from __future__ import annotations

import os
from pathlib import Path

from shardcheck.errors import HintsFormatError, InputError
from shardcheck.fsio import nothing_read, why_unreadable, write_text_or_stdout
from shardcheck.hints.codec import validated
from shardcheck.hints.extension import hints_text, loads_hints_or_extension
from shardcheck.hints.model import ShardHints

# A hints file lists a few hundred tensors at most; anything far bigger is not a hints file.
MAX_HINTS_BYTES = 64 * 1024 * 1024


def read_text_input(path: str | os.PathLike[str], what: str) -> str:
    """The text of an input file, or an InputError that names it."""
    file = Path(path)
    if not os.fspath(path):  # Path("") is the current directory
        raise InputError(f"'': the path of {what} is empty")
    if os.fspath(path) == "-" and not file.exists():
        raise InputError(f"-: reading {what} from standard input is not supported; give its path")
    problem = why_unreadable(file, what)
    if problem:
        raise InputError(f"{path}: {problem}")
    try:
        # Read at most one byte past the limit: a pipe or a device reports no size.
        with file.open("rb") as stream:
            data = stream.read(MAX_HINTS_BYTES + 1)
        if len(data) > MAX_HINTS_BYTES:
            raise InputError(f"{path}: too large to be {what}")
    except PermissionError:
        raise InputError(f"{path}: permission denied") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not data:
        raise InputError(f"{path}: {nothing_read(file, what)}")
    if not data.strip():
        raise InputError(f"{path}: empty file (only white space), expected {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}), expected {what}") from None


def read_hints(path: str | os.PathLike[str]) -> ShardHints:
    """The hints of a hints file, or of shardcheck's extension file (hints/extension.py):
    then with the lengths it gives."""
    text = read_text_input(path, "a JSON hints file")
    return loads_hints_or_extension(text, source=str(path))


def write_hints(path: str, hints: ShardHints) -> None:
    """Write ``hints`` (to standard output for ``-``); hints that the reader would refuse
    (made in Python) are refused before anything is written. Hints with lengths (the
    extension) are written as an extension file, all others in Polygraphy's format."""
    write_text_or_stdout(path, hints_text(validated(hints)))


__all__ = ["HintsFormatError", "read_hints", "read_text_input", "write_hints"]
