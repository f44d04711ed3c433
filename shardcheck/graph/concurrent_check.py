"""``onnx.checker`` on the second core while the analysis runs on the first.

The checker is a C++ call that holds the GIL for its whole run (a tenth to a fifth of a second
on a 32k-node model), so a thread cannot overlap it with anything. A forked child can: it
shares the parsed model and the file's bytes with the parent (copy on write), runs
``ParsedModel.check`` and sends back its one-line error, if any. The parent analyses in the
meantime and takes the verdict before it writes anything: a model the checker refuses is refused
exactly as before, with the same message, and whatever the analysis made of it is dropped. The
check includes the walk over the nodes for duplicate names and external tensors in attributes;
a child that passes the model sends the external weight files it found, so that the parent never
makes that walk itself.

Where there is no ``fork`` (Windows), or other threads are running, native ones included
(forking beside them is unsafe), the check simply runs first, in the process itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from shardcheck.errors import ModelError
from shardcheck.graph.loader import ParsedModel

# The child's answer: _PASSED + the external weight files its walk over the nodes found (JSON),
# or _FAILED + the checker's message.
_PASSED, _FAILED = b"P", b"E"


@contextmanager
def checked_concurrently(parsed: ParsedModel) -> Iterator[None]:
    """Run the body while ``parsed.check()`` runs in a child process.

    On leaving, the checker's verdict comes first: a ModelError from it replaces any error the
    body raised (the body analysed an invalid model). A body that fails on a valid model has
    its own error propagated.
    """
    child = _start(parsed)
    if child is None:
        parsed.check()
        yield
        return
    try:
        yield
    except Exception:
        _finish(parsed, child)
        raise
    except BaseException:  # interrupted: the verdict no longer matters
        _stop(child)
        raise
    _finish(parsed, child)


def _can_fork() -> bool:
    return hasattr(os, "fork") and _single_threaded()


def _single_threaded() -> bool:
    """No other thread, Python's or native (onnxruntime's, a library's): a child forked beside
    one may inherit a lock it holds, and wait for it forever."""
    if threading.active_count() != 1:
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no /proc (macOS): Python's own threads are all that can be counted
        return True


def _start(parsed: ParsedModel) -> tuple[int, int] | None:
    """Fork the checker; (pid, read end of its pipe), or None to check in the process."""
    if not _can_fork():
        return None
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:  # the child: check, answer, and leave without running any exit handler
        status = 1
        try:
            os.close(read_end)
            try:
                parsed.check()
                locations = sorted(parsed.external_locations())
                answer = _PASSED + json.dumps(locations).encode("utf-8")
            except ModelError as exc:
                answer = _FAILED + exc.message.encode("utf-8", "replace")
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(answer)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, read_end


def _stop(child: tuple[int, int]) -> None:
    pid, read_end = child
    os.close(read_end)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _finish(parsed: ParsedModel, child: tuple[int, int]) -> None:
    pid, read_end = child
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        # The child died without an answer (killed, out of memory): check here instead, so that
        # the verdict and its message are the same as without a child.
        parsed.check()
        return
    if answer.startswith(_FAILED):
        raise ModelError(answer[len(_FAILED) :].decode("utf-8", "replace")) from None
    parsed.mark_checked(set(json.loads(answer[len(_PASSED) :])))
