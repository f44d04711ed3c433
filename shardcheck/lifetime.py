"""Objects freed by the process's exit instead of one at a time.

The console command leaves with ``os._exit`` (``cli.main``), which frees everything at once.
What a command made and no longer needs can be handed here, so that it lives until then:
freeing a large model's index and onnxruntime sessions one object at a time is a visible part
of a short command (docs/performance.md has the figure). Anywhere else (the API, tests)
nothing is kept: ``keep_until_exit`` does nothing until ``free_at_exit`` has been called.
"""

from __future__ import annotations

_kept: list[object] | None = None


def free_at_exit() -> None:
    """From now on, what is handed to ``keep_until_exit`` lives until the process ends: only
    for a process that ends with ``os._exit`` right after its one command."""
    global _kept
    if _kept is None:
        _kept = []


def free_when_done() -> None:
    """For a command of many models (check): what each one made is freed when it is done,
    not kept until the exit, where it would all add up."""
    global _kept
    _kept = None


def keep_until_exit(*objects: object) -> None:
    if _kept is not None:
        _kept.extend(objects)


def kept() -> tuple[object, ...] | None:
    """What lives until the exit, or None when nothing is kept (not the console command)."""
    return None if _kept is None else tuple(_kept)
