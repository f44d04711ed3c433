"""How a command stops early: a signal (SIGINT, SIGTERM, SIGHUP) or a closed stdout pipe.

A signal becomes an exception in the main thread, so that what a command was writing is
removed on the way out (the atomic writer's temporary file, shard's weight copies) for every
one of them, as Python does for SIGINT alone. Each stop leaves click's own handling with
``Stopped``: click would print a blank line for an interrupt and exit 1 on a closed pipe,
which for ``diff`` means "different".
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

# The exit code of a process whose reader went away (128 + SIGPIPE), as a shell reports a
# program that SIGPIPE ended: its own code, neither a verdict (0, 1) nor bad input (2).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
_CLEANED_UP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as SIGINT's KeyboardInterrupt is: every
    ``finally`` and ``except BaseException`` cleanup runs for it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(BaseException):
    """The command stops with ``exit_code``, and ``message`` (when not None) as its error
    line. A BaseException that click does not catch."""

    def __init__(self, exit_code: int, message: str | None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


def stopped_by(exc: BaseException) -> Stopped | None:
    """The Stopped that ``exc`` means (an interrupt, a signal, a closed stdout), or None."""
    if isinstance(exc, Signalled):
        return Stopped(128 + exc.signum, f"terminated by {signal.Signals(exc.signum).name}")
    if isinstance(exc, KeyboardInterrupt):
        return Stopped(128 + signal.SIGINT, "interrupted")
    if isinstance(exc, BrokenPipeError):
        _silence_stdout()
        return Stopped(EXIT_BROKEN_PIPE, None)
    return None


def _raise_signalled(signum: int, _frame: object) -> None:
    raise Signalled(signum)


def clean_up_on_signals() -> None:
    """SIGTERM and SIGHUP raise Signalled in the main thread (the console command only:
    a library must not take a process's signals)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _CLEANED_UP_SIGNALS:
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _raise_signalled)


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the closed pipe must not fail
    again at the exit's flush."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
