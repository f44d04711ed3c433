"""gen's extension file: written beside the hints where the extension splits more.

``gen M -o HINTS.json`` writes ``HINTS.shardcheck.json`` too when the extension's plan runs
more of the projection and MLP FLOPs on slices (generation/extension.py), and says on stderr
how much each plan splits. The hints file stays Polygraphy's format either way. An extension
file left from an earlier gen of the same path is removed when the new plan needs none (it
would be stale); a file there that is not one is never touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardcheck.errors import InputError, OutputError
from shardcheck.fsio import atomic_write_text, same_file
from shardcheck.generation.extension import Extended, shares_line
from shardcheck.hints.extension import dumps_extension, extension_path, is_extension_file


def extension_target(output: str) -> str | None:
    """Where the extension of hints written to ``output`` goes; None for standard output,
    a stream or a device (nothing is written beside those)."""
    if output == "-":
        return None
    target = Path(output)
    if target.exists() and not target.is_file():
        return None
    return extension_path(output)


def write_extension(output: str, model: str, extended: Extended | None) -> tuple[str | None, str]:
    """Write (or remove the stale) extension of ``output``; the file written (None when none)
    and the line that says so (empty when there is nothing to say)."""
    target = extension_target(output)
    if extended is None:
        if target is not None and is_extension_file(target):
            os.remove(target)
            return None, f"{target}: removed: the hints need no extension now"
        return None, ""
    if target is None:
        return None, f"{output}: {shares_line(extended, None)} (not written beside {output})"
    if same_file(target, model) or same_file(target, output):
        raise InputError(f"{target}: is an input; write the hints elsewhere")
    if _exists(target) and not is_extension_file(target):
        return None, (
            f"{target}: not a shardcheck extension file; left as it is, the extension not "
            f"written ({shares_line(extended, None)})"
        )
    try:
        atomic_write_text(target, dumps_extension(extended.hints))
    except OutputError as exc:  # the hints are written: gen succeeds, and says why not this
        return None, f"{exc.message}; the extension not written ({shares_line(extended, None)})"
    return target, f"{output}: {shares_line(extended, target)}"


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:  # a name too long to be a file's: nothing is there
        return False
