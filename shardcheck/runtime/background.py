"""A call run in a background thread: onnxruntime makes sessions there while Python works.

onnxruntime releases the GIL while it loads a model and makes its kernels, so the analysis in
the main thread runs on the other core meanwhile. The thread is a daemon, but a process must
not end while onnxruntime works in one (the interpreter's teardown under it crashes): callers
wait for what they started before an error leaves them, and the console command leaves with
``os._exit`` (cli.main).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class InBackground(Generic[T]):
    """``function(*args)``, started now in a daemon thread named ``name``."""

    def __init__(self, name: str, function: Callable[..., T], *args: object) -> None:
        self._value: list[T] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._call, args=(function, args), name=name, daemon=True
        )
        self._thread.start()

    def _call(self, function: Callable[..., T], args: tuple[object, ...]) -> None:
        try:
            self._value.append(function(*args))
        except BaseException as exc:  # handed to the caller's thread by result()
            self._error.append(exc)

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
