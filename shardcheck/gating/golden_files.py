"""What a golden path may be read as, and whether an update may replace or remove the file.

A golden path comes from a manifest or a test's name; the file there is the user's. It is read
only when it is a regular file (a FIFO would block the gate, a device never ends), and it is
replaced or removed only when it is a hints file, or a broken one: a JSON object with a hints
file's keys, text that is not JSON but spells one of those keys (cut short, or hand-edited
wrong), an empty file, or a golden left with merge-conflict markers. Anything else
(a project's settings file, a model saved as JSON, weights) is never overwritten.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from shardcheck.hints.codec import FLAT_KEYS, NEW_KEYS

# Enough of a file to tell a hints file (or a broken one) from another file.
_SNIFF_BYTES = 64 * 1024 * 1024
_CONFLICT_MARKERS = (b"<<<<<<< ", b"\n=======\n", b">>>>>>> ")
_HINTS_KEYS = frozenset((*NEW_KEYS, *FLAT_KEYS))


def not_a_regular_file(path: Path) -> str | None:
    """Why the golden at ``path`` is neither missing nor a regular file, or None. Links are
    followed: a link to a device is a device."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, expected a JSON hints file"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"is {kind}, not a regular file"


def may_replace(path: Path) -> bool:
    """Whether an update may replace (or, stale, remove) the regular file at ``path``."""
    if not_a_regular_file(path) is not None:
        return False
    try:
        with open(path, "rb") as stream:
            data = stream.read(_SNIFF_BYTES + 1)
    except OSError:
        return False
    if len(data) > _SNIFF_BYTES:
        return False
    if not data.strip():
        return True
    if all(marker in data for marker in _CONFLICT_MARKERS):
        return True
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        # Not JSON: a golden cut short, or hand-edited wrong, still spells a hints key.
        return any(f'"{key}"'.encode() in data for key in _HINTS_KEYS)
    return isinstance(document, dict) and bool(_HINTS_KEYS & document.keys())


def remove_stale(path: Path) -> bool:
    """Remove a stale golden if it is a hints file; whether it was removed."""
    if os.path.islink(path) or not may_replace(path):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True
