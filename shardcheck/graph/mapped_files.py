"""Files mapped read-only, each once per process while anything uses it: the external weight
files, and the model files whose large inline weights are lent to onnxruntime where they lie in
them (inline_weights.py).

A file is mapped only after its size has been checked, on the open file, against what is read
from it: mapping past the end of a file (one truncated after the model was checked) would kill
the process with SIGBUS when the page is touched. A file that shrinks once mapped still does;
nothing short of copying it could prevent that.

A model file whose weights are left in it is remembered as it was when parsed (its identity:
device, inode, size, modification time): its weights are taken from it later, at the offsets
the parse found, so a model file that has changed since is refused rather than read there.
This module imports neither numpy nor onnx: gen reads models through it.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from pathlib import Path
from typing import Any

from shardcheck.errors import InputError

Identity = tuple[int, int, int, int]  # device, inode, size, modification time (ns)

# file identity -> its mapping, while anything uses it.
_MAPPINGS: weakref.WeakValueDictionary[Identity, mmap.mmap] = weakref.WeakValueDictionary()
# model file (resolved) -> its identity when a parse left its inline weights in it, and what
# holds the places of those weights (while it lives, no other parse of a changed file may).
_PARSED: dict[str, tuple[Identity, weakref.ref[Any]]] = {}
_LOCK = threading.Lock()


def identity(status: os.stat_result) -> Identity:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def mapped(file: Path, needed: int, tensor: str, source: str) -> mmap.mmap:
    """The one read-only mapping of ``file``, which must hold at least ``needed`` bytes for
    ``tensor`` (InputError otherwise, ``source`` names the model), and be as it was parsed
    if it is a model file whose inline weights are read from it."""
    descriptor, key = checked_open(file, needed, tensor, source)
    try:
        return _mapping(descriptor, key)
    finally:
        os.close(descriptor)


def checked_open(file: Path, needed: int, tensor: str, source: str) -> tuple[int, Identity]:
    """``file`` opened for reading (the caller closes it), and its identity, after the checks
    of ``mapped``."""
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
        key = identity(status)
        parsed = _PARSED.get(str(file))
        if parsed is not None and parsed[0] != key:
            raise InputError(
                f"{source}: the model file {file.name!r} changed while shardcheck ran (it had "
                f"{parsed[0][2]} bytes when read, {status.st_size} now): its large inline "
                f"weights, {tensor!r} among them, are read from the file itself; run again once "
                "nothing writes to it"
            )
        if status.st_size < needed:
            raise InputError(
                f"{source}: tensor {tensor!r} needs the first {needed} bytes of {file.name!r}, "
                f"which now has {status.st_size}: the weight file is incomplete (was it cut "
                "short or rewritten while shardcheck ran?)"
            )
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, key


def _mapping(descriptor: int, key: Identity) -> mmap.mmap:
    with _LOCK:
        mapping = _MAPPINGS.get(key)
        if mapping is None:
            mapping = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
            _MAPPINGS[key] = mapping
    return mapping


def may_lend(file: Path, parsed: Identity) -> bool:
    """Whether a parse of the model file ``file`` (resolved), as ``parsed``, may leave its
    weights in it: not while the places that an earlier parse of it, then otherwise, found
    are still in use."""
    with _LOCK:
        earlier = _PARSED.get(str(file))
        return earlier is None or earlier[0] == parsed or earlier[1]() is None


def remember_lending(file: Path, parsed: Identity, owner: Any) -> None:
    """A parse of ``file`` as ``parsed`` left its weights in it, at places ``owner`` holds:
    ``mapped`` refuses the file once it has changed."""
    with _LOCK:
        _PARSED[str(file)] = (parsed, weakref.ref(owner))
