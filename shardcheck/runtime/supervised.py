"""A timeout that holds, even for one long kernel of onnxruntime.

onnxruntime looks at ``RunOptions.terminate`` only between nodes, so one long kernel (a MatMul
of minutes) runs to its end whatever the timeout; a thread cannot be stopped. Here the whole
call (verify's analysis, its runs, the CP simulation's runs) is made in a child process that
tells its parent when each run starts and ends (``watched_run``). When a run has taken the
timeout and GRACE_SECONDS more, the parent kills the child, which frees all its memory, and
raises the timeout's error. What the child raises or returns comes back as it is.

The child is forked where that is safe: in a process that has no other thread and has made
no onnxruntime session (``check``'s, which makes its runs in children only), so that one child
per model costs little. Elsewhere (pytest's process, the plugin's) it is spawned: a process
with onnxruntime's state or threads cannot be forked safely, and a spawned child costs the
startup of a Python process with onnxruntime.

The console command needs no child: its process may end. There ``runs_bounded`` gives the
bound of the runs, and past it (and the grace) ``end_process_when_overdue``'s callback says so
and ends the process, which frees what the run held.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from shardcheck.errors import AnalysisError, InputError, ShardcheckError

if TYPE_CHECKING:  # multiprocessing is imported when a child is made: not by every command
    import multiprocessing.context
    from multiprocessing.connection import Connection

T = TypeVar("T")

# How long past its timeout a run may go before its process is killed: onnxruntime's own
# terminate, checked between nodes, stops most runs within it, with their own message.
GRACE_SECONDS = 2.0
# How often the parent looks at a child that says nothing (it may have died).
_POLL_SECONDS = 0.5

_to_parent: Connection | None = None  # set in a supervised child only
_run_ids = itertools.count()
# The console's bound: (seconds a run may take, the model file), and what ends the process.
_bound: tuple[float, str] | None = None
_end_process: Callable[[str], None] | None = None


def end_process_when_overdue(end: Callable[[str], None]) -> None:
    """From now on, a run past the bound of ``runs_bounded`` calls ``end`` with the error's
    message (from a timer thread); ``end`` must end the process (the console command only)."""
    global _end_process
    _end_process = end


@contextlib.contextmanager
def runs_bounded(timeout: float | None, source: str) -> Iterator[None]:
    """Within it, each onnxruntime run of this process may take ``timeout`` seconds (with
    ``end_process_when_overdue``); None: no bound."""
    global _bound
    before = _bound
    _bound = None if timeout is None else (timeout, source)
    try:
        yield
    finally:
        _bound = before


def overdue_message(source: str, timeout: float, label: str) -> str:
    return (
        f"{source}: onnxruntime did not finish within --timeout {timeout} s ({label}); its "
        "process was stopped: give it more time or use shorter lengths"
    )


def in_supervised_child() -> bool:
    return _to_parent is not None


@contextlib.contextmanager
def watched_run(label: str) -> Iterator[None]:
    """One onnxruntime run (``label``: "sequence length 16", to name it in the error); in a
    supervised child, the parent hears when it starts and when it ends."""
    if _to_parent is None:
        with _ended_when_overdue(label):
            yield
        return
    run = next(_run_ids)  # runs may overlap (threads): each is told apart
    _to_parent.send(("start", (run, label)))
    try:
        yield
    finally:
        _to_parent.send(("end", (run, label)))


@contextlib.contextmanager
def _ended_when_overdue(label: str) -> Iterator[None]:
    bound, end = _bound, _end_process
    if bound is None or end is None:
        yield
        return
    timeout, source = bound
    timer = threading.Timer(
        timeout + GRACE_SECONDS, end, (overdue_message(source, timeout, label),)
    )
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def send_progress(message: str) -> None:
    """The child's progress callback: the parent shows the message."""
    if _to_parent is not None:
        _to_parent.send(("progress", message))


def run_supervised(
    function: Callable[..., T],
    kwargs: dict[str, Any],
    *,
    timeout: float,
    source: str,
    progress: Callable[[str], None] | None = None,
) -> T:
    """``function(**kwargs)`` in a child process, each onnxruntime run of it bounded by
    ``timeout`` seconds (see the module docstring). ``function`` must be importable by name
    and ``kwargs`` picklable; ``progress`` hears the child's progress messages."""
    context = _child_context()
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(
        target=_child_main, args=(sender, function, kwargs), name="shardcheck-runs", daemon=True
    )
    child.start()
    sender.close()
    running: dict[int, tuple[str, float]] = {}  # the runs under way: label, when it started
    try:
        while True:
            oldest = min(running.values(), key=lambda run: run[1], default=None)
            wait = _POLL_SECONDS
            if oldest is not None:
                wait = min(wait, max(0.0, oldest[1] + timeout + GRACE_SECONDS - time.monotonic()))
            if receiver.poll(wait):
                try:
                    kind, value = receiver.recv()
                except EOFError:
                    child.join()
                    raise InputError(
                        f"{source}: the process running onnxruntime ended without an answer "
                        f"(exit code {child.exitcode})"
                    ) from None
                if kind == "start":
                    running[value[0]] = (value[1], time.monotonic())
                elif kind == "end":
                    running.pop(value[0], None)
                elif kind == "progress":
                    if progress is not None:
                        progress(value)
                elif kind == "result":
                    return value  # type: ignore[no-any-return]
                else:  # "error": the child's ShardcheckError, as (exit code, message)
                    code, message = value
                    error: ShardcheckError = (
                        AnalysisError(message) if code == 1 else InputError(message)
                    )
                    raise error
            elif oldest is not None and time.monotonic() >= oldest[1] + timeout + GRACE_SECONDS:
                raise InputError(overdue_message(source, timeout, oldest[0]))
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()


def _child_context() -> multiprocessing.context.BaseContext:
    """``fork`` where it is safe (the module docstring), else ``spawn``."""
    import multiprocessing

    from shardcheck.runtime.sessions import made_a_session

    safe = hasattr(os, "fork") and threading.active_count() == 1 and not made_a_session()
    if not safe:
        return multiprocessing.get_context("spawn")
    # Imported once here, each forked child has it: importing it makes no session or thread.
    import onnxruntime  # noqa: F401

    return multiprocessing.get_context("fork")


def _child_main(
    to_parent: Connection, function: Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    global _to_parent
    _to_parent = to_parent
    try:
        result = function(**kwargs)
    except ShardcheckError as exc:
        to_parent.send(("error", (exc.exit_code, exc.message)))
    except BaseException as exc:  # a bug: said as the console command says one
        to_parent.send(("error", (2, f"internal error: {type(exc).__name__}: {exc}")))
    else:
        to_parent.send(("result", result))
    to_parent.close()
    # onnxruntime may still be making a session in a thread: no interpreter teardown.
    os._exit(0)
