"""Files mapped read-only, each once per process while anything uses it: the external weight
files, and the model files whose large inline weights are read where they lie in them
(inline_weights.py).

A file is mapped only after its size has been checked, on the open file, against what is read
from it: mapping past the end of a file (one truncated after the model was checked) would kill
the process with SIGBUS when the page is touched. A file that shrinks once mapped still does;
nothing short of copying it could prevent that.

A model file read through its mapping is remembered as it was when parsed (its identity:
device, inode, size, modification time): its weights are taken from it later, at the offsets
the parse found, so a model file that has changed since is refused rather than read there.
This module imports neither numpy nor onnx: gen reads models through it.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import weakref
from pathlib import Path

from shardcheck.errors import InputError

Identity = tuple[int, int, int, int]  # device, inode, size, modification time (ns)

# file identity -> its mapping, while anything uses it.
_MAPPINGS: weakref.WeakValueDictionary[Identity, mmap.mmap] = weakref.WeakValueDictionary()
# model file (resolved) -> its identity when its parse lent its inline weights from it.
_PARSED: dict[str, Identity] = {}
_LOCK = threading.Lock()


def _identity(status: os.stat_result) -> Identity:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def mapped(file: Path, needed: int, tensor: str, source: str) -> mmap.mmap:
    """The one read-only mapping of ``file``, which must hold at least ``needed`` bytes for
    ``tensor`` (InputError otherwise, ``source`` names the model), and be as it was parsed
    if it is a model file whose inline weights are read from it."""
    try:
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        what = "model file" if str(file) in _PARSED else "external weight file"
        raise InputError(
            f"{source}: {what} {file.name!r} of tensor {tensor!r} cannot be opened: "
            f"{error.strerror or error}"
        ) from None
    try:
        status = os.fstat(descriptor)
        key = _identity(status)
        parsed = _PARSED.get(str(file))
        if parsed is not None and parsed != key:
            raise InputError(
                f"{source}: the model file {file.name!r} changed while shardcheck ran (it had "
                f"{parsed[2]} bytes when read, {status.st_size} now): its large inline weights, "
                f"{tensor!r} among them, are read from the file itself; run again once nothing "
                "writes to it"
            )
        if status.st_size < needed:
            raise InputError(
                f"{source}: tensor {tensor!r} needs the first {needed} bytes of {file.name!r}, "
                f"which now has {status.st_size}: the weight file is incomplete (was it cut "
                "short or rewritten while shardcheck ran?)"
            )
        return _mapping(descriptor, key)
    finally:
        os.close(descriptor)


def _mapping(descriptor: int, key: Identity) -> mmap.mmap:
    with _LOCK:
        mapping = _MAPPINGS.get(key)
        if mapping is None:
            mapping = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
            _MAPPINGS[key] = mapping
    return mapping


def map_model_file(file: Path, smallest: int) -> mmap.mmap | None:
    """The mapping of the model file ``file`` (resolved) for its parse, remembered as it is
    now (``mapped`` refuses it once it has changed); None when it is not a regular file of at
    least ``smallest`` bytes, cannot be mapped, or has changed since an earlier parse whose
    mapping is still in use (whose offsets are then still those read from it)."""
    try:
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_size < max(smallest, 1):
            return None
        key = _identity(status)
        with _LOCK:
            earlier = _PARSED.get(str(file))
            if earlier is not None and earlier != key and _MAPPINGS.get(earlier) is not None:
                return None
            _PARSED[str(file)] = key
        return _mapping(descriptor, key)
    except OSError:  # a file system that cannot map
        return None
    finally:
        os.close(descriptor)
