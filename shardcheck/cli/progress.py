"""Progress on stderr for the commands that can run long (simulate, verify).

Nothing is shown in a command's first second: a quick run prints no progress at all. After it,
the current step is shown on a terminal, as one line updated in place with the seconds spent
and cleared when the command is done, so that an error is still the one line left on stderr.
Elsewhere (a CI log) nothing is shown: a line per step would stay, and an error after it would
no longer be stderr's one line. stdout, where --format json goes, is never written.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType

import click

# A command that is done within this many seconds shows no progress.
QUIET_SECONDS = 1.0
# How often the terminal's line is redrawn.
TICK_SECONDS = 0.25


class Progress:
    """Steps of a command, shown on stderr once it has run QUIET_SECONDS; a context manager
    that clears its line on leaving. ``enabled=False`` (``-q``) shows nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._started = time.monotonic()
        self._step = ""
        self._drawn = False  # a terminal line is on screen
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._terminal = _is_terminal()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self._enabled and self._terminal:
            self._thread = threading.Thread(target=self._watch, name="shardcheck-progress")
            self._thread.daemon = True
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._drawn:
                click.echo("\r\033[K", nl=False, err=True)
                self._drawn = False

    def __call__(self, step: str) -> None:
        """Now doing ``step`` (shown as ``shardcheck: STEP``)."""
        with self._lock:
            self._step = step
        if self._enabled and self._terminal and time.monotonic() - self._started >= QUIET_SECONDS:
            self._show()

    def _watch(self) -> None:
        wait = max(0.0, QUIET_SECONDS - (time.monotonic() - self._started))
        if self._done.wait(wait):
            return
        while True:
            self._show()
            if self._done.wait(TICK_SECONDS):
                return

    def _show(self) -> None:
        with self._lock:
            if not self._step or self._done.is_set():
                return
            seconds = int(time.monotonic() - self._started)
            click.echo(f"\r\033[Kshardcheck: {self._step} {seconds} s", nl=False, err=True)
            self._drawn = True


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
