"""A call run in a background thread: onnxruntime makes sessions there while Python works.

onnxruntime releases the GIL while it loads a model and makes its kernels, so the analysis in
the main thread runs on the other core meanwhile. The thread is a daemon, but a process must
not end while onnxruntime works in one (the interpreter's teardown under it crashes): callers
wait for what they started before an error leaves them, and the console command leaves with
``os._exit`` (cli.main).

While such a call runs, the interpreter's switch interval is lowered to HANDOFF_INTERVAL:
onnxruntime's thread takes the GIL back several times while it makes a session, and with the
default interval (5 ms) it waits each time for the busy main thread to let it go.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# Short enough that onnxruntime's thread gets the GIL back nearly as soon as it asks, long
# enough that the main thread's Python is not slowed by the switching (docs/performance.md).
HANDOFF_INTERVAL = 0.0002

_handoff_lock = threading.Lock()
_handoff_users = 0
_handoff_found = 0.0  # the interval before the first user lowered it
_handoff_set: float | None = None  # the interval it was lowered to (as the interpreter keeps it)


def _lower_interval() -> None:
    """The interpreter's switch interval at most HANDOFF_INTERVAL until the matching
    _restore_interval (process-wide: concurrent calls share it)."""
    global _handoff_users, _handoff_found, _handoff_set
    with _handoff_lock:
        if _handoff_users == 0:
            _handoff_found = sys.getswitchinterval()
            _handoff_set = None
            if _handoff_found > HANDOFF_INTERVAL:
                sys.setswitchinterval(HANDOFF_INTERVAL)
                _handoff_set = sys.getswitchinterval()
        _handoff_users += 1


def _restore_interval() -> None:
    """The last one out restores the interval found, unless someone changed it meanwhile."""
    global _handoff_users
    with _handoff_lock:
        _handoff_users -= 1
        if _handoff_users == 0 and _handoff_set == sys.getswitchinterval():
            sys.setswitchinterval(_handoff_found)


class InBackground(Generic[T]):
    """``function(*args)``, started now in a daemon thread named ``name``."""

    def __init__(self, name: str, function: Callable[..., T], *args: object) -> None:
        self._value: list[T] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._call, args=(function, args), name=name, daemon=True
        )
        _lower_interval()
        try:
            self._thread.start()
        except BaseException:
            _restore_interval()
            raise

    def _call(self, function: Callable[..., T], args: tuple[object, ...]) -> None:
        try:
            self._value.append(function(*args))
        except BaseException as exc:  # handed to the caller's thread by result()
            self._error.append(exc)
        finally:
            _restore_interval()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the call has ended (waiting at most ``timeout`` seconds for it)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> T:
        """The call's value, once it has ended; its exception is raised here."""
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self._value[0]
